// Group-wise int4 weights in 16-row panels (services/kernels/int4_panels.py: a copy of an Int4Weight, kept where the
// kernel plan chose this kernel), times bf16 x on CPUs with AVX512-BF16: y = x @ W^T (+ bias), weight-only (x exact).
//
// Legend: M rows of x, K input features, Kp = K padded to whole 64-column blocks, N output features, G = 32 columns
// per group, P = ceil(N / 16) panels (the last one's missing rows zero), O = Kp / 8 column octets.
//   x:      [M, K]               bfloat16
//   packed: [P, O, 64] uint8     octet o of panel p (W rows 16p .. 16p + 15, columns 8o .. 8o + 7): byte 16L + i
//                                holds, for row 16p + 4L + (i % 8) / 2 and c = 2 * (i >= 8) + i % 2, q of column 8o + c
//                                in its low nibble and q of column 8o + c + 4 in its high one
//   scale, low: [P, Kp / G, 16] float16: w[n, k] = q * scale + low of row n's group k / G, q in 0..15
//   bias:   [N]                  optional, any float dtype (added in float32)
//   y:      [M, N]               bfloat16, accumulated in float32, rounded once
//
// Why the panels: the row layout (int4_linear.cpp) re-reads x for every W row (two 64-byte loads per 32 bytes of W)
// and pays a row's reduction per row; here an octet's 64 bytes, masked, shifted and interleaved with 0x43
// (unpacklo/hi_epi8), are four registers of bf16 words 0x43qq = 128 + q in which lane r holds row r's two columns
// 8o + 2u, 8o + 2u + 1 (u = the register), so each vdpbf16ps takes one broadcast pair of x, all 16 rows'
// sums stay in the lanes, and x costs 4 bytes a 64 bytes of W. Then, per group,
//   y[m, n] += scale * D + (low - 128 * scale) * sum(x[m] over the group),   D = sum (128 + q) * x.
// AMD EPYC Zen 4, 2 threads, weights cycled from memory: 16384 x 2048 0.70 against the best row-layout kernel's
// 0.76 ms, 2048 x 8192 0.42 against 0.69, 3072 x 2048 0.155 against 0.179 (docs/kernels.md).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "int4_panel_octets.h"
#include "panel_rows.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

using panel_rows::kPanel;
constexpr int64_t kGroup = 32;
constexpr int64_t kAheadBytes = 1024;  // prefetch distance in all (each of S streams: 1 / S of it)

// out[(s * MT + m) * 16 + r] = x row m . W row 16 (p + s * apart) + r, for S panels `apart` apart (S > 1 only with
// MT = 1) and MT rows of x. x: bf16 pairs as int32 [MT, Kp / 2]; xsum: [MT, Kp / G] float32, x's group sums.
// Each row's dots run as C chains (register u feeds chain u % C): enough chains in all to hide vdpbf16ps' latency,
// and few enough registers (S MT (C + 1) + 6) that 8 rows fit — a pass of 8 rows unpacks each octet for 32 dots,
// 1.2-1.3x faster at 8 and 32 rows than passes of 4 (AMD EPYC Zen 4, 2 threads).
template <int MT, int S, int Locality>
void panel_dots(const uint8_t* packed, const at::Half* scale, const at::Half* low, int64_t p, int64_t apart,
                const int32_t* x, const float* xsum, int64_t Kp, float* out) {
  static_assert(MT == 1 || S == 1, "several panels at once for one x row only");
  constexpr int C = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
  const int64_t groups = Kp / kGroup, octets = Kp / 8;
  __m512 acc[S][MT];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m) acc[s][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 d[S][MT][C];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < MT; ++m)
        for (int c = 0; c < C; ++c) d[s][m][c] = _mm512_setzero_ps();
    for (int64_t o = 4 * g; o < 4 * g + 4; ++o)
      for (int s = 0; s < S; ++s) {
        const uint8_t* at = packed + ((p + s * apart) * octets + o) * 64;
        __builtin_prefetch(at + kAheadBytes / S, 0, Locality);
        __m512i w[4];
        int4_panels::octet_words(at, w);
        for (int u = 0; u < 4; ++u)
          for (int m = 0; m < MT; ++m)
            d[s][m][u % C] = _mm512_dpbf16_ps(d[s][m][u % C], (__m512bh)w[u],
                                              (__m512bh)_mm512_set1_epi32(x[m * Kp / 2 + 4 * o + u]));
      }
    for (int s = 0; s < S; ++s) {
      const int64_t at = ((p + s * apart) * groups + g) * kPanel;
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at)));
      const __m512 lw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + at)));
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), sc, lw);
      for (int m = 0; m < MT; ++m) {
        __m512 D = d[s][m][0];  // C = 4: pairs first
        if constexpr (C == 4) D = _mm512_add_ps(_mm512_add_ps(D, d[s][m][1]), _mm512_add_ps(d[s][m][2], d[s][m][3]));
        if constexpr (C == 2) D = _mm512_add_ps(D, d[s][m][1]);
        acc[s][m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[m * groups + g]), _mm512_fmadd_ps(D, sc, acc[s][m]));
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + (s * MT + m) * kPanel, acc[s][m]);
}

struct Dots {
  const uint8_t* packed;
  const at::Half *scale, *low;
  const int32_t* x;   // [M, Kp / 2] bf16 pairs, zero past K
  const float* xsum;  // [M, Kp / G]
  int64_t Kp;

  template <int MT, int S, int Locality>
  void run(int64_t p, int64_t apart, int64_t m0, float* sums) const {
    panel_dots<MT, S, Locality>(packed, scale, low, p, apart, x + m0 * Kp / 2, xsum + m0 * Kp / kGroup, Kp, sums);
  }
};

}  // namespace

torch::Tensor int4_panel_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                                const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias,
                                int64_t streams, bool non_temporal) {
  panel_rows::check_call(x, streams);
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + 63) / 64 * 64;
  int4_panels::check_copy(packed, scale, low, N, Kp);
  const torch::Tensor bias32 = panel_rows::float_bias(bias, N);
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  // x padded with zeros to Kp, and its group sums (of the bf16 values, in float32): 32 values widened and added at
  // once (a scalar loop took 2.6% of the `1b` int4 batch-32 step)
  std::vector<at::BFloat16> xp(M * Kp, at::BFloat16(0.f));
  std::vector<float> xsum(M * Kp / kGroup);
  const torch::Tensor xc = x.contiguous();
  const at::BFloat16* xv = xc.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < M; ++m) {
    std::copy(xv + m * K, xv + (m + 1) * K, xp.begin() + m * Kp);
    for (int64_t g = 0; g < Kp / kGroup; ++g) {
      const __m512i words = _mm512_loadu_si512(xp.data() + m * Kp + g * kGroup);  // 32 bf16: float32's high halves
      const __m256i first = _mm512_castsi512_si256(words), second = _mm512_extracti64x4_epi64(words, 1);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(first), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(second), 16));
      xsum[m * Kp / kGroup + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
  panel_rows::run<1>(Dots{packed.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), low.data_ptr<at::Half>(),
                          reinterpret_cast<const int32_t*>(xp.data()), xsum.data(), Kp},
                     bias32, M, N, y.data_ptr<at::BFloat16>(), streams, non_temporal);
  return y;
}

#endif  // AVX512-BF16
