// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers, shared by the kernels that turn rows into columns
// (pair_tiled_linear.cpp: W rows into bf16 pair panels; amx_linear.cpp: the tile unit's [W rows, x rows] sums into
// rows of y).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

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
#endif
