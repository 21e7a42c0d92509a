// The register tiles of the bf16 pair panels (bf16_panel_linear.cpp's layout), shared by the kernels that multiply
// rows of x by such panels: bf16_panel_linear.cpp (the copy of a bf16 weight) and int8_panel_tiled_linear.cpp (an
// int8 weight's panels converted into this layout a panel at a time).
//
// Legend: MT rows of x, K2 column pairs (a multiple of 4), S panels `apart` apart.
//   panels: [P, K2, 16]  int32: lane r of entry (p, j) holds the bf16 pair (W[16p + r, 2j], W[16p + r, 2j + 1])
//   x:      [MT, K2]     int32: bf16 pairs of x's rows, zero past K
//   out:    [S, MT, 16]  float32: out[(s * MT + m) * 16 + r] = x row m . W row 16 (p + s * apart) + r
#pragma once

#include <torch/extension.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <cstdint>

namespace bf16_panel_dots {

constexpr int64_t kPanel = 16;
constexpr int64_t kAheadBytes = 1024;  // prefetch distance in all (each of S streams: 1 / S of it)

// The chains a row's dots run as by default: enough in all to hide vdpbf16ps' latency, few enough registers
// (S MT C <= 16) to fit. They depend on MT alone, so an output is the same sum in the same order whichever S (the
// streams of one row, a panel pair or a lone panel) computed it.
template <int MT>
constexpr int kChains = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;

// out = x's MT rows . the S panels' rows; each row's dots as C chains (entry j feeds chain j % 4 % C); C = 1: every
// output one sum in the order of j, whatever MT (int8_panel_tiled_linear: pair_tiled_linear's order).
template <int MT, int S, int Locality, int C = kChains<MT>>
void panel_dots(const int32_t* panels, int64_t p, int64_t apart, const int32_t* x, int64_t K2, float* out) {
  static_assert(S * MT * C <= 16 && (C == 1 || C == 2 || C == 4), "accumulators past the registers");
  __m512 acc[S][MT][C];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m)
      for (int c = 0; c < C; ++c) acc[s][m][c] = _mm512_setzero_ps();
  const int32_t* panel[S];
  for (int s = 0; s < S; ++s) panel[s] = panels + (p + s * apart) * K2 * kPanel;
  for (int64_t j0 = 0; j0 < K2; j0 += 4)  // K2 is a multiple of 4
    for (int u = 0; u < 4; ++u)
      for (int s = 0; s < S; ++s) {
        const int32_t* at = panel[s] + (j0 + u) * kPanel;
        __builtin_prefetch(reinterpret_cast<const char*>(at) + kAheadBytes / S, 0, Locality);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(at);
        for (int m = 0; m < MT; ++m)
          acc[s][m][u % C] = _mm512_dpbf16_ps(acc[s][m][u % C], w, (__m512bh)_mm512_set1_epi32(x[m * K2 + j0 + u]));
      }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m) {
      __m512 sum = acc[s][m][0];  // C = 4: pairs first
      if constexpr (C == 4)
        sum = _mm512_add_ps(_mm512_add_ps(sum, acc[s][m][1]), _mm512_add_ps(acc[s][m][2], acc[s][m][3]));
      if constexpr (C == 2) sum = _mm512_add_ps(sum, acc[s][m][1]);
      _mm512_storeu_ps(out + (s * MT + m) * kPanel, sum);
    }
}

}  // namespace bf16_panel_dots

#endif  // AVX512-BF16
