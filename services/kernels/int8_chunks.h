// int8 W rows as bf16 for the tile unit (amx_rows.h's Int8Rows), 64 columns at a time by table lookups, and the
// column order that puts them in.
//
// Legend: a chunk is 64 columns of one W row (int8, one cache line), converted into two 32-column halves (bf16, one
// tile row each). The halves hold the chunk's columns in the order two byte unpacks leave them:
//   half 0: columns 0-7, 16-23, 32-39, 48-55      half 1: columns 8-15, 24-31, 40-47, 56-63
// Pairs of adjacent columns stay together, so x is put in the same order by moving its bf16 pairs (32-bit units):
// ordered_units(x32, M, units) -> [M, units], each whole chunk's 32 units as the halves above; a last half chunk
// (K % 64 == 32) as it was, converted column by column (int8_half).
//
// Why: converting by float conversions (a sign extension, an integer-to-float conversion per 16 columns and a
// rounding to bf16 per 32) bound the int8 batch product on the vector units: 32 rows x 16384 x 2048 with W in the
// caches took 1.20 ms, and from memory 1.60-1.99 against 1.27-1.35 for its reads alone. A bf16 of an integer |w| <=
// 128 is a 7-bit table lookup per byte (vpermi2b) for its high and its low byte, the sign or'ed in, the bytes
// interleaved: 1.02 ms in the caches, 1.32 from memory (Intel Xeon, family 6 model 207, 2 threads; /tmp harness,
// 9 rounds).
#pragma once

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace int8_chunks {

// bf16(m) for m = 0..127 as two 128-byte tables (high bytes, low bytes), two registers each
struct Table {
  __m512i hi0, hi1, lo0, lo1;
  Table() {
    alignas(64) uint8_t hi[128], lo[128];
    for (int m = 0; m < 128; ++m) {
      const uint16_t bits = at::BFloat16(static_cast<float>(m)).x;
      hi[m] = static_cast<uint8_t>(bits >> 8);
      lo[m] = static_cast<uint8_t>(bits & 0xFF);
    }
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
  }
};

// 64 int8 at src -> two halves of 32 bf16 (the legend's order), exact for every int8
inline void chunk(const Table& t, const int8_t* src, at::BFloat16* half0, at::BFloat16* half1) {
  const __m512i v = _mm512_loadu_si512(src);
  const __m512i m = _mm512_abs_epi8(v);  // |v|; -128 stays 0x80: looked up as 0, its high byte set below
  __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, m, t.hi1), v,
                                         _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // table | (v & sign)
  hi = _mm512_mask_mov_epi8(hi, _mm512_movepi8_mask(m), _mm512_set1_epi8(static_cast<char>(0xC3)));  // bf16(-128)
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, m, t.lo1);
  _mm512_storeu_si512(half0, _mm512_unpacklo_epi8(lo, hi));
  _mm512_storeu_si512(half1, _mm512_unpackhi_epi8(lo, hi));
}

// 32 int8 at src -> 32 bf16 in column order (a last half chunk)
inline void int8_half(const int8_t* src, at::BFloat16* out) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// x32 [M, units] (bf16 pairs) in the chunks' order (the legend)
inline std::vector<int32_t> ordered_units(const int32_t* x32, int64_t M, int64_t units) {
  std::vector<int32_t> out(x32, x32 + M * units);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c + 32 <= units; c += 32)
      for (int64_t q = 0; q < 32; ++q)  // unit q of the chunk: half q / 16, its (q % 16 / 4)-th run of 4 pairs
        out[m * units + c + q] = x32[m * units + c + (q % 16 / 4) * 8 + (q / 16) * 4 + q % 4];
  return out;
}

}  // namespace int8_chunks
#endif
