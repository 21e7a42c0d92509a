// w8a8 on CPUs with AVX512-VNNI or AVX2: each row of x rounded to int8 with its own scale, times int8 W, the products
// exact in int32, then both scales applied — bit for bit linear_candidates._int8_dynamic_mm, torch's operators for
// the same definition, so the plan may pick either for any row count and a request's answer never depends on it.
//
// Legend: M rows of x, N rows of W (output features), K columns; x [M, K] float32 / bf16 / fp16, w [N, K] int8 in
// [-127, 127], scale [N] float32, bias [N] in x's dtype or None, y [M, N] in x's dtype. Per row m of x:
// xs[m] = max(max_k |x[m, k]|, 1e-30) / 127 (float32), xq[m, k] = round(x[m, k] / xs[m]) (halves to even),
// dot[m, n] = sum_k xq[m, k] w[n, k] (int32, exact), y[m, n] = dtype(float(dot) * xs[m] * scale[n]), then
// y + bias rounded to the dtype again (torch adds the bias after the rounding). kStep = the columns of one vector
// step, Kp = K rounded up to kStep (xq is zero there), MR = 4 rows of x and NR W rows (4 with AVX-512, 2 with AVX2)
// per register tile, kBlock = 32 W rows (64-256 KB of the `1b` shapes: L2) swept by every tile of x in turn.
//
// Why: torch's int8 x int8 product (`torch._int_mm`) runs 136 multiply-accumulates per ns at 32 and 1,024 rows on an
// AMD EPYC Zen 4 against the ~445 its vpdpbusd can do, and reads W at half the weight-only int8 kernel's rate for
// one row; on AVX2 CPUs it is a reference loop (Zen 3: ~11 s for 1,024 rows of 16384 x 2048).
#pragma GCC optimize("fp-contract=off")  // y * scale + bias: two roundings, as torch's operators

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "thread_chunks.h"
#include "vec_load.h"

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

#include "row_rounding.h"  // RoundedX, round_rows
#include "w8a8_x_panels.h"  // panel_product (AVX512-VNNI)

namespace {

constexpr int64_t kMR = 4, kBlock = 32;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kStep = 64, kNR = 4;

// acc += u (unsigned bytes) . v (signed), 4 pairs per int32 lane, in place: through its intrinsic GCC 12 copied each
// accumulator to another register and back around every vpdpbusd (and spilled some), ~1/3 of its rate.
inline void dpbusd(__m512i& acc, __m512i u, __m512i v) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(v)); }

// dots[4 i + j] = xq row i . W row j for MR rows of x, kNR of W. W's bytes as unsigned (w ^ 0x80 = w + 128), so
// vpdpbusd takes them against signed x; the caller subtracts 128 * sum(xq). The last step masks W past K. Every loop
// over the accumulators is unrolled by pragma, or GCC keeps them in memory.
template <int MR>
inline void tile(const int8_t* xq, int64_t Kp, const int8_t* const w[kNR], int64_t K, bool fetch, int32_t dots[16]) {
  __m512i acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask64 tail = K % kStep ? (__mmask64{1} << (K % kStep)) - 1 : ~__mmask64{0};
  for (int64_t k = 0; k < Kp; k += kStep) {
    const __mmask64 live = k + kStep <= K ? ~__mmask64{0} : tail;
    __m512i wv[kNR];
#pragma GCC unroll 4
    for (int j = 0; j < kNR; ++j) wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, w[j] + k), flip);
    if (fetch) {  // the first tile of x to read these W rows: the next tile's rows, 4 K bytes ahead, into L2
#pragma GCC unroll 4
      for (int j = 0; j < kNR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w[j] + kNR * K + k), _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_loadu_si512(xq + i * Kp + k);
#pragma GCC unroll 4
      for (int j = 0; j < kNR; ++j) dpbusd(acc[4 * i + j], wv[j], xv);
    }
  }
  // the 16 sums, in order: two rounds of unpack + add, two of 128-bit shuffles + add
  __m512i a[8], b[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2 * i], acc[2 * i + 1]),
                            _mm512_unpackhi_epi32(acc[2 * i], acc[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: partial sums of acc[4i .. 4i + 3]
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  const __m512i c0 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88), _mm512_shuffle_i32x4(b[0], b[1], 0xDD));
  const __m512i c1 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x88), _mm512_shuffle_i32x4(b[2], b[3], 0xDD));
  _mm512_storeu_si512(dots, _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, 0x88), _mm512_shuffle_i32x4(c0, c1, 0xDD)));
}
constexpr int32_t kOffset = 128;  // W's bytes were read as w + 128

#else  // AVX2: vpmaddubsw takes |w| (unsigned) against x with w's sign (vpsignb), pairs summed in int16
constexpr int64_t kStep = 32, kNR = 2;

// The 8 sums of v[0..7] (8 int32 lanes each), in order.
inline __m256i sum8(__m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// dots[2 i + j] = xq row i . W row j. |w| |x| <= 127 * 127, so a pair's int16 sum (<= 32,258) cannot saturate;
// vpmaddwd by ones widens them to int32. W's tail past K is read by bytes into a zeroed step.
template <int MR>
inline void tile(const int8_t* xq, int64_t Kp, const int8_t* const w[kNR], int64_t K, bool fetch, int32_t dots[16]) {
  __m256i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t tail[kNR][kStep];
  for (int64_t k = 0; k < Kp; k += kStep) {
    __m256i wabs[kNR], wv[kNR];
    for (int j = 0; j < kNR; ++j) {
      const int8_t* p = w[j] + k;
      if (K - k < kStep) {
        std::fill(tail[j], tail[j] + kStep, 0);
        std::copy(p, w[j] + K, tail[j]);
        p = tail[j];
      }
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      wabs[j] = _mm256_abs_epi8(wv[j]);
      if (fetch) _mm_prefetch(reinterpret_cast<const char*>(w[j] + kNR * K + k), _MM_HINT_T1);  // as VNNI's tile
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * Kp + k));
      for (int j = 0; j < kNR; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(wabs[j], _mm256_sign_epi8(xv, wv[j]));
        acc[2 * i + j] = _mm256_add_epi32(acc[2 * i + j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots), sum8(acc));
}
constexpr int32_t kOffset = 0;
#endif

// Every tile of x against W rows [n0, n1) (one block), y's outputs stored as they come.
template <int MR, typename T>
void block_tile(const RoundedX& x, int64_t m0, const int8_t* w, int64_t n0, int64_t n1, int64_t K, const float* scale,
                const T* bias, T* y, int64_t N) {
  alignas(64) int32_t dots[16];
  for (int64_t j0 = n0; j0 < n1; j0 += kNR) {
    const int8_t* rows[kNR];
    const int64_t live = std::min(kNR, n1 - j0);
    for (int j = 0; j < kNR; ++j) rows[j] = w + std::min(j0 + j, n1 - 1) * K;  // past n1: a live row again, unused
    tile<MR>(x.q.data() + m0 * x.Kp, x.Kp, rows, K, m0 == 0, dots);
    for (int i = 0; i < MR; ++i)
      for (int64_t j = 0; j < live; ++j)
        w8a8_value(dots[kNR * i + j] - kOffset * x.sum[m0 + i], x.s[m0 + i], scale[j0 + j],
                   bias ? bias + j0 + j : nullptr, y + (m0 + i) * N + j0 + j);
  }
}

template <typename T>
void product(const T* x, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* scale, const T* bias, T* y,
             bool panels) {
  const RoundedX rounded = round_rows(x, M, K, kStep);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (panels) return panel_product(rounded, M, w, N, K, scale, bias, y);
#endif
  parallel_chunks((N + kBlock - 1) / kBlock, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, n1 = std::min(N, n0 + kBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kMR) switch (std::min(kMR, M - m0)) {
          case 1: block_tile<1>(rounded, m0, w, n0, n1, K, scale, bias, y, N); break;
          case 2: block_tile<2>(rounded, m0, w, n0, n1, K, scale, bias, y, N); break;
          case 3: block_tile<3>(rounded, m0, w, n0, n1, K, scale, bias, y, N); break;
          default: block_tile<4>(rounded, m0, w, n0, n1, K, scale, bias, y, N);
        }
    }
  });
}

}  // namespace

// The legend's y = x_q @ (w * scale)^T (+ bias), in x's dtype: by the 4 x NR register tiles, or (panels, AVX512-VNNI
// builds) by w8a8_x_panels.h's. The same result bit for bit; which is faster depends on the shape (and the CPU), so
// the plan times both.
static torch::Tensor w8a8_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                  const c10::optional<torch::Tensor>& bias, bool panels) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "w8a8_linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && scale.scalar_type() == torch::kFloat && scale.numel() == w.size(0),
              "w8a8_linear: w int8 [N, K], scale float32 [N]");
  TORCH_CHECK(!bias || (bias->scalar_type() == x.scalar_type() && bias->numel() == w.size(0)),
              "w8a8_linear: bias [N] in x's dtype");
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scale.contiguous();
  const c10::optional<torch::Tensor> bc = bias ? c10::optional<torch::Tensor>(bias->contiguous()) : c10::nullopt;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    product(xc.data_ptr<T>(), M, K, wc.data_ptr<int8_t>(), N, sc.data_ptr<float>(), bc ? bc->data_ptr<T>() : nullptr,
            y.data_ptr<T>(), panels);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "w8a8_linear: x float32, bf16 or fp16");
  }
  return y;
}

#endif  // AVX512-VNNI or AVX2

torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias) {
  return w8a8_product(x, w, scale, bias, false);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
torch::Tensor w8a8_panel_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& bias) {
  return w8a8_product(x, w, scale, bias, true);
}
#endif
