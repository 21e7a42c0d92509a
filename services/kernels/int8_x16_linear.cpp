// Per-channel int8 weights times x held as int16 per group, for decode on CPUs whose float32 arithmetic
// cannot keep up with int8's bytes (AVX2 without AVX-512: Zen 1-3, Intel client cores).
//
// Legend: M rows of x, K input features, Kp = K padded to whole groups, N output features,
// G = 32 columns per group, groups = Kp / G.
//   x:      [M, K]   float32 / bfloat16 / float16
//   w:      [N, K]   int8 in [-127, 127];  scale: [N] float32:  w[n, k] ~= q[n, k] * scale[n]
//   bias:   [N]      optional, x's dtype
//   y:      [M, N]   x's dtype, accumulated in float32
//
// What it computes: x as x16_groups.h makes it (xq int16, xscale per group), then
//   y[m, n] = scale[n] * sum_g xscale[m, g] * (q_g . xq_g)
// Why: the products become integer multiply-adds, 16 per instruction (vpmaddwd: q sign-extended to int16,
// pairs summed into int32; a group's sum is at most 32 * 127 * 32767 < 2^31), where float32 needs two
// conversions and an FMA per 8 weights. Threads take N's rows in chunks (thread_chunks.h); each W row is read once
// per 4 rows of x.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "x16_groups.h"
#include "vec_load.h"

// Without AVX2, FMA and F16C there is no such kernel (bindings.cpp leaves the name out; the plan never offers it).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

constexpr int64_t kGroup = 32;

// acc[m * R + r] = sum_g xscale[m, g] * (w_r,g . xq_m,g) for MT rows of x (xq [*, Kp], xscale [*, groups])
// against R W rows of K int8, `apart` rows from one to the next (R > 1 only with MT = 1: the registers hold
// MT x R x 2 accumulators); the last group, when K is not whole groups, in scalar code: the row ends there. Each
// row's arithmetic is the same for any R, so its result is bit-identical.
template <int MT, int R, int Locality>
void dot_rows(const int16_t* xq, const float* xscale, int64_t Kp, const int8_t* w, int64_t apart, int64_t K,
              float* acc) {
  static_assert(MT == 1 || R == 1, "several W rows at once for one x row only");
  const int64_t groups = Kp / kGroup, whole = K / kGroup;
  __m256 vacc[MT][R][2];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) vacc[m][r][0] = vacc[m][r][1] = _mm256_setzero_ps();
  auto group = [&](int64_t g, int a) __attribute__((always_inline)) {
    __m256i w0[R], w1[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* wg = w + r * apart * K + g * kGroup;
      // a cache line per two groups, kPrefetchBytes ahead in all (x16_groups.h: each of R streams a 1 / R of
      // it), into the caches or past them (Locality 0)
      if ((g & 1) == 0) __builtin_prefetch(wg + kPrefetchBytes / R, 0, Locality);
      w0[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg)));
      w1[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16)));
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i* xg = reinterpret_cast<const __m256i*>(xq + m * Kp + g * kGroup);
      const __m256i x0 = _mm256_loadu_si256(xg), x1 = _mm256_loadu_si256(xg + 1);
      const __m256 xs = _mm256_broadcast_ss(xscale + m * groups + g);
      for (int r = 0; r < R; ++r) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0[r], x0), _mm256_madd_epi16(w1[r], x1));  // [8] int32
        vacc[m][r][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), xs, vacc[m][r][a]);
      }
    }
  };
  int64_t g = 0;
  for (; g + 2 <= whole; g += 2) {  // two groups' chains in flight
    group(g, 0);
    group(g + 1, 1);
  }
  if (g < whole) group(g, 0);
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) {
      float total = sum8(_mm256_add_ps(vacc[m][r][0], vacc[m][r][1]));
      if (whole < groups) {  // the last, partial group: xq is 0 past K
        int64_t dot = 0;
        for (int64_t k = whole * kGroup; k < K; ++k) dot += w[r * apart * K + k] * xq[m * Kp + k];
        total += xscale[m * groups + whole] * static_cast<float>(dot);
      }
      acc[m * R + r] = total;
    }
}

}  // namespace

torch::Tensor int8_x16_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous CPU int8 [N, K]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) == K, "x [M, K] expected, K = ", K);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "scale must be a contiguous float32 [N]");
  const int64_t Kp = (K + kGroup - 1) / kGroup * kGroup, groups = Kp / kGroup;
  const X16Groups r = x16_groups(x, Kp);
  const int8_t* wv = w.data_ptr<int8_t>();
  const float* sv = scale.data_ptr<float>();
  return with_prefetch_locality(non_temporal, [&](auto locality) {
    auto rows = [&](auto tile, auto parts, int64_t m, int64_t n, int64_t apart, float* acc) {
      constexpr int MT = decltype(tile)::value, R = decltype(parts)::value;
      dot_rows<MT, R, decltype(locality)::value>(r.xq.data() + m * Kp, r.xscale.data() + m * groups, Kp, wv + n * K,
                                                 apart, K, acc);
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < R; ++j) acc[i * R + j] *= sv[n + j * apart];
    };
    return x16_product(x, N, bias, streams, rows);
  });
}

#endif  // AVX2, FMA, F16C
