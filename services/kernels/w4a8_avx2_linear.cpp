// w4a8 on CPUs with AVX2 but not AVX512-VNNI (AMD Zen 1-3, Intel client cores): the product of w4a8_linear.cpp, the
// same shapes, layout and float32 chain (w4a8_panels.h), so the same results bit for bit; only the int8 dot product
// differs: vpmaddubsw (q unsigned x xi signed, pairs summed into int16: at most 2 * 15 * 127 = 3810, no saturation),
// eight of them added in int16 per group (at most 30480 < 32767), then one vpmaddwd by ones into int32.
//
// Legend (beyond w4a8_panels.h's): MR <= 2 rows of x per pass over a panel (two 8-lane halves each: 4 float and 4
// int16 accumulators, the registers' limit with W's and x's), PB = 4 panels re-read from L1/L2 by every MR rows.
// One path for every row count (each output's chain never depends on how many rows share the call).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec_load.h"
#include "thread_chunks.h"
#include "w4a8_panels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))

namespace {

using w4a8::GroupScale, w4a8::kGroup, w4a8::kPanel, w4a8::RoundedRows, w4a8::Panels, w4a8::store_row;
constexpr int64_t kMR = 2, kPanelBlock = 4;

// Group k0 of row x [K] (zeros past K) rounded as w4a8_panels.h says: its int8 values into q [32], its s and z.
template <typename T>
inline GroupScale round_group(const T* x, int64_t K, int64_t k0, int8_t* q) {
  alignas(32) float v[kGroup];
  const int64_t len = std::min(kGroup, K - k0);
  for (int64_t k = 0; k < len; ++k) v[k] = static_cast<float>(x[k0 + k]);
  std::fill(v + len, v + kGroup, 0.f);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_load_ps(v + 8 * i), magnitude));
  const float amax = max8(top), s = amax / 127.f;
  // vcvtps2dq rounds halves to even (the default rounding mode), as torch.round does
  const __m256 d = _mm256_set1_ps(amax > 0.f ? s : 1.f);
  alignas(32) int32_t levels[kGroup];
  for (int i = 0; i < 4; ++i)
    _mm256_store_si256(reinterpret_cast<__m256i*>(levels + 8 * i),
                       _mm256_cvtps_epi32(_mm256_div_ps(_mm256_load_ps(v + 8 * i), d)));
  int32_t total = 0;  // exact in any order
  for (int64_t k = 0; k < kGroup; ++k) {
    q[k] = static_cast<int8_t>(levels[k]);  // within +-127
    total += levels[k];
  }
  return {s, s * static_cast<float>(total)};
}

// acc = fma(low, z, fma(float(dot), scale * s, acc)): one group's step of 8 outputs' chains
inline __m256 group_step(__m256i dot, __m256 scale, __m256 low, float s, float z, __m256 acc) {
  const __m256 scaled = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(s)), acc);
  return _mm256_fmadd_ps(low, _mm256_set1_ps(z), scaled);
}

// Rows m0 .. m0 + MR of y against panel p.
template <int MR, typename T>
void panel_rows(const Panels& w, const RoundedRows& x, int64_t m0, int64_t p, const float* bias, T* y) {
  const int64_t groups = w.Kp / kGroup;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[MR][2];  // int16 pair sums of each lane
    for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    for (int64_t o = 4 * g; o < 4 * g + 4; ++o) {
      const uint8_t* octet = w.octet(p, o);
      __builtin_prefetch(octet + 1024, 0, 3);  // 16 octets (two groups) ahead in this panel's stream
      __m256i xb[MR][2];  // columns 8o .. 8o + 3 and 8o + 4 .. 8o + 7 of each row, in every lane
      for (int m = 0; m < MR; ++m)
        for (int i = 0; i < 2; ++i)
          xb[m][i] = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x.q.data() + (m0 + m) * w.Kp + 8 * o + 4 * i));
      for (int h = 0; h < 2; ++h) {  // rows 0-7, 8-15 of the panel
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(octet + 32 * h));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int m = 0; m < MR; ++m) {
          dot[m][h] = _mm256_add_epi16(dot[m][h], _mm256_maddubs_epi16(lo, xb[m][0]));
          dot[m][h] = _mm256_add_epi16(dot[m][h], _mm256_maddubs_epi16(hi, xb[m][1]));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = load8(w.group_scale(p, g) + 8 * h), low = load8(w.group_low(p, g) + 8 * h);
      for (int m = 0; m < MR; ++m)
        acc[m][h] = group_step(_mm256_madd_epi16(dot[m][h], ones), scale, low, x.s[(m0 + m) * groups + g],
                               x.z[(m0 + m) * groups + g], acc[m][h]);
    }
  }
  const int64_t live = std::min(kPanel, w.N - p * kPanel);
  for (int m = 0; m < MR; ++m) {
    alignas(32) float sums[kPanel];
    _mm256_store_ps(sums, acc[m][0]);
    _mm256_store_ps(sums + 8, acc[m][1]);
    store_row(sums, bias ? bias + p * kPanel : nullptr, live, y + (m0 + m) * w.N + p * kPanel);
  }
}

// Threads take the panels in chunks (thread_chunks.h), PB panels of a chunk at a time past every MR rows of x (one
// pass for a decode step).
template <typename T>
void product(const Panels& w, const T* x, int64_t M, int64_t K, const float* bias, T* y) {
  const RoundedRows xr = w4a8::round_rows(x, M, K, w.Kp, round_group<T>);
  parallel_chunks(w.panels, [&](int64_t p0, int64_t p1) {
    for (int64_t b = p0; b < p1; b += kPanelBlock)
      for (int64_t m0 = 0; m0 < M; m0 += kMR)
        for (int64_t p = b; p < std::min(b + kPanelBlock, p1); ++p) {
          if (M - m0 >= kMR)
            panel_rows<kMR>(w, xr, m0, p, bias, y);
          else
            panel_rows<1>(w, xr, m0, p, bias, y);
        }
  });
}

}  // namespace

// See w4a8_panels.h: y = x_q @ W^T (+ bias) in x's dtype, W [N, K] in panels.
torch::Tensor w4a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias) {
  return w4a8::call(x, packed, scale, low, N, bias, [](const Panels& w, const auto* xv, int64_t M, int64_t K,
                                                       const float* b, auto* y) { product(w, xv, M, K, b, y); });
}

#endif  // AVX2 without AVX512-VNNI
