// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers, shared by the kernels that turn rows into columns
// (pair_tiled_linear.cpp: W rows into bf16 pair panels; amx_linear.cpp: the tile unit's [W rows, x rows] sums into
// rows of y).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <vector>

// 16 rows of 16 int32 each -> out[j] = (rows[0][j], ..., rows[15][j])
inline void transpose16(const __m512i in[16], __m512i out[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i)  // a[4i + h]: rows 4i, 4i + 1 (h = 0: columns 4L, 4L + 1; h = 1: 4L + 2, 4L + 3)
    for (int h = 0; h < 2; ++h) {
      b[4 * i + 2 * h] = _mm512_unpacklo_epi64(a[4 * i + h], a[4 * i + 2 + h]);
      b[4 * i + 2 * h + 1] = _mm512_unpackhi_epi64(a[4 * i + h], a[4 * i + 2 + h]);
    }
  // b[4i + c]: 128-bit lane L holds column 4L + c of rows 4i .. 4i + 3; gather each column's four lanes
  for (int c = 0; c < 4; ++c) {
    const __m512i lo01 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), hi01 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i lo23 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i hi23 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    out[c] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
    out[8 + c] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);
    out[4 + c] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);
  }
}

// x's rows as the tile unit's B operand: x32 [M, units] (each row's 32-bit units: bf16 pairs, int8 quads) ->
// [units / 16, ceil(M / 16), 16, 16]: step s, tile t, unit r, lane m = x32[16t + m, 16s + r], zeros past M.
// (amx_linear.cpp and amx_w8a8_linear.cpp; units a multiple of 16)
inline std::vector<int32_t> tile_columns(const int32_t* x32, int64_t M, int64_t units) {
  const int64_t S = units / 16, Mt = (M + 15) / 16;
  std::vector<int32_t> xb(S * Mt * 256);
  for (int64_t t = 0; t < Mt; ++t)
    for (int64_t s = 0; s < S; ++s) {
      __m512i in[16], out[16];
      for (int64_t m = 0; m < 16; ++m)
        in[m] = 16 * t + m < M ? _mm512_loadu_si512(x32 + (16 * t + m) * units + 16 * s) : _mm512_setzero_si512();
      transpose16(in, out);
      for (int64_t r = 0; r < 16; ++r) _mm512_storeu_si512(xb.data() + ((s * Mt + t) * 16 + r) * 16, out[r]);
    }
  return xb;
}
#endif
