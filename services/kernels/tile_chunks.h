// Quantized W rows as bf16 rows of tiles (amx_rows.h's Int8Chunks and Int4Chunks), 64 columns at a time by byte-table
// lookups, and x put in the column order those leave them in.
//
// Legend: a chunk is 64 columns of one W row (int8: 64 bytes; int4: 32 bytes of nibbles, int4_block.h), looked up
// byte by byte into the low and the high bytes of 64 bf16, which two byte unpacks interleave into two halves of 32
// (one tile row each). Half h, word 8L + i (lane L = 0..3, i = 0..7) comes from byte 16L + 8h + i (unpacked_byte):
// int8's column of that number, int4's int4::block_column of it. Pairs of adjacent words meet
// pairs of x in the tile product, so x is put in the same order (ordered_tile_columns): each product is the same sum.
//
// Why: converting by float conversions (int8: a sign extension, an integer-to-float conversion per 16 columns and a
// rounding per 32) bound the batch products on the vector units. 32 rows x 16384 x 2048 on 2 threads (Intel Xeon,
// family 6 model 207; /tmp harnesses, medians of 7-9 rounds): int8 with W in the caches 1.20 -> 1.02 ms, from
// memory 1.60 -> 1.32 (its reads alone 1.27-1.35); int4 by word lookups in column order (int4::block_bf16) 2.10 ->
// 1.76 ms from memory, 1.81 -> 1.57 in the caches.
#pragma once

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "int4_block.h"
#include "transpose16.h"

namespace tile_chunks {

constexpr int64_t kChunk = 64;

// The byte of a chunk that position p (half p / 32) comes from (the legend).
constexpr int unpacked_byte(int p) { return 16 * (p % 32 / 8) + 8 * (p / 32) + p % 8; }

// tile_columns (transpose16.h) of x32 [M, units] (x's bf16 pairs) over padded_units, each whole chunk's 32 units in
// the chunks' order (the legend; column_of_byte: the W format's), zeros past x's units (int4's Kp); a last half chunk
// (int8, K % 64 == 32) in column order. Pairs stay whole: a pair of positions comes from one pair of bytes, whose
// columns are a pair. Why here, not as an ordered copy of x first: that copy (and its fresh pages) cost a 2048 x 8192
// int4 product a tenth of its time.
template <typename ColumnOfByte>
std::vector<int32_t> ordered_tile_columns(const int32_t* x32, int64_t M, int64_t units, int64_t padded_units,
                                          const ColumnOfByte& column_of_byte) {
  alignas(64) int32_t unit[kChunk / 2];  // position pair q's unit within the chunk
  for (int q = 0; q < kChunk / 2; ++q) unit[q] = column_of_byte(unpacked_byte(2 * q)) / 2;
  const __m512i picks[2] = {_mm512_load_si512(unit), _mm512_load_si512(unit + 16)};
  auto load16 = [&](const int32_t* row, int64_t at) {  // units at .. at + 15 of a row, zeros past x's
    const int64_t n = std::clamp<int64_t>(units - at, 0, 16);
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << n) - 1), row + at);
  };
  const int64_t S = padded_units / 16, Mt = (M + 15) / 16;
  std::vector<int32_t> xb(S * Mt * 256);
  for (int64_t t = 0; t < Mt; ++t)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t chunk = s / 2 * (kChunk / 2);  // the chunk's first unit
      __m512i in[16], out[16];
      for (int64_t m = 0; m < 16; ++m) {
        const int32_t* row = x32 + (16 * t + m) * units;
        if (16 * t + m >= M)
          in[m] = _mm512_setzero_si512();
        else if (chunk + kChunk / 2 <= padded_units)
          in[m] = _mm512_permutex2var_epi32(load16(row, chunk), picks[s % 2], load16(row, chunk + 16));
        else
          in[m] = load16(row, 16 * s);
      }
      transpose16(in, out);
      for (int64_t r = 0; r < 16; ++r) _mm512_storeu_si512(xb.data() + ((s * Mt + t) * 16 + r) * 16, out[r]);
    }
  return xb;
}

// bf16(m) for m = 0..127 as two 128-byte tables (high bytes, low bytes), two registers each
struct Int8Table {
  __m512i hi0, hi1, lo0, lo1;
  Int8Table() {
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
inline void int8_chunk(const Int8Table& t, const int8_t* src, at::BFloat16* half0, at::BFloat16* half1) {
  const __m512i v = _mm512_loadu_si512(src);
  const __m512i m = _mm512_abs_epi8(v);  // |v|; -128 stays 0x80: looked up as 0, its high byte set below
  __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, m, t.hi1), v,
                                         _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // table | (v & sign)
  hi = _mm512_mask_mov_epi8(hi, _mm512_movepi8_mask(m), _mm512_set1_epi8(static_cast<char>(0xC3)));  // bf16(-128)
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, m, t.lo1);
  _mm512_storeu_si512(half0, _mm512_unpacklo_epi8(lo, hi));
  _mm512_storeu_si512(half1, _mm512_unpackhi_epi8(lo, hi));
}

// 32 int8 at src -> 32 bf16 in column order (int8's last half chunk, K % 64 == 32)
inline void int8_half(const int8_t* src, at::BFloat16* out) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// int4 block b of one row (int4_block.h) -> two halves of 32 bf16 (the legend's order): each column's group's
// bf16(fma(q, scale, low)), int4::block_bf16's values. The two groups' 16 values each are made once (one FMA a group)
// into 32 words, split into their low bytes (table bytes 0-31) and high bytes (32-63); the nibbles, 16 added in the
// second group's bytes, pick from them.
inline void int4_chunk(const uint8_t* packed, int64_t b, const float* sc, const float* lo, at::BFloat16* half0,
                       at::BFloat16* half1) {
  struct Split {
    alignas(64) uint8_t bytes[kChunk];  // the 32 words' low bytes, then their high bytes
  };
  static const Split split = [] {
    Split o{};
    for (int i = 0; i < 32; ++i) {
      o.bytes[i] = static_cast<uint8_t>(2 * i);
      o.bytes[32 + i] = static_cast<uint8_t>(2 * i + 1);
    }
    return o;
  }();
  const __m512i index = int4::group_indices(packed, b);
  const __m512i table = _mm512_permutexvar_epi8(_mm512_load_si512(split.bytes), int4::group_values(sc, lo, b));
  const __m512i low_bytes = _mm512_permutexvar_epi8(index, table);
  const __m512i high_bytes = _mm512_permutexvar_epi8(_mm512_or_si512(index, _mm512_set1_epi8(32)), table);
  _mm512_storeu_si512(half0, _mm512_unpacklo_epi8(low_bytes, high_bytes));
  _mm512_storeu_si512(half1, _mm512_unpackhi_epi8(low_bytes, high_bytes));
}

}  // namespace tile_chunks
#endif
