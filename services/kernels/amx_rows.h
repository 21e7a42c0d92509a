// Where amx_linear.cpp's A tiles come from, one struct per weight format: load(s) puts step s's 32 W rows x 32 columns
// (bf16) into tiles 4 and 5. Shapes and the legend: amx_linear.cpp.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int4_block.h"
#include "rows_ahead.h"

namespace amx_rows {

// kAhead: steps a W row is prefetched ahead (2, 8, 16: 2-10% slower; prefetching into L1, L2 or L3 alike)
constexpr int64_t kNB = 32, kStep = 32, kAhead = 4;

// bf16 W: each step's A tiles straight from its rows
struct Bf16Rows {
  const at::BFloat16* w;  // the block's first row
  int64_t K;
  const at::BFloat16* next;  // the next block's first row, nullptr where none (rows_ahead.h)
  void load(int64_t s) const {
    const at::BFloat16* at = w + s * kStep;
    if (const at::BFloat16* ahead = rows_ahead(w, next, s, kAhead, K / kStep, kStep))
      for (int64_t r = 0; r < kNB; ++r) __builtin_prefetch(ahead + r * K, 0, 3);
    _tile_loadd(4, at, K * 2);
    _tile_loadd(5, at + 16 * K, K * 2);
  }
};

// int8 W: each step's 32 x 32 block converted to bf16 (exact: |w| <= 127 fits bf16's 8 bits) one step ahead of its
// tile loads, into the other half of `converted`: converted and loaded in the same step, 8 rows of 16384 x 2048 took
// 2.76 ms against 1.82 (separate runs of a noisy hour; a whole 32-row block converted at once, 128-512 KB, was slower
// still), as if a tile load waited on the stores of its own bytes.
struct Int8Rows {
  const int8_t* w;  // the block's first row
  int64_t K, S;
  at::BFloat16* converted;  // [2, 32, 32]: steps alternate halves
  const int8_t* next;  // the next block's first row, nullptr where none (rows_ahead.h)

  void convert(int64_t s) const {
    const int8_t* at = w + s * kStep;
    at::BFloat16* out = converted + s % 2 * kNB * kStep;
    const int8_t* ahead = s % 2 == 0 ? rows_ahead(w, next, s, kAhead, S, kStep) : nullptr;  // a line: two steps
    for (int64_t r = 0; r < kNB; ++r) {
      if (ahead) __builtin_prefetch(ahead + r * K, 0, 3);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + r * K));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
      _mm512_storeu_si512(out + r * kStep, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  void load(int64_t s) const {
    if (s == 0) convert(0);
    if (s + 1 < S) convert(s + 1);
    const at::BFloat16* at = converted + s % 2 * kNB * kStep;
    _tile_loadd(4, at, 64);
    _tile_loadd(5, at + 16 * kStep, 64);
  }
};

// int4 W (group-wise, int4_block.h): each 64-column block of the 32 rows as bf16 (block_bf16: int4's prefill path's
// values, int4_dequantize) one block ahead of its two steps' tile loads, into the other half of `converted` (why ahead:
// Int8Rows).
struct Int4Rows {
  const uint8_t* packed;  // the block's first row: [32, Kp / 2]
  const float *scale, *low;  // [32, Kp / 32] each, the block's group parameters as float32 (row_params)
  int64_t Kp, live, S;  // live: rows of the block within N (the others: zeros)
  at::BFloat16* converted;  // [2, 32, 64]: 64-column blocks alternate halves

  void convert(int64_t blk) const {
    at::BFloat16* out = converted + blk % 2 * kNB * 64;
    const int64_t groups = Kp / int4::kGroup;
    for (int64_t r = 0; r < kNB; ++r) {
      if (r >= live) {
        std::memset(out + r * 64, 0, 64 * sizeof(at::BFloat16));
        continue;
      }
      __builtin_prefetch(packed + r * Kp / 2 + (blk + 4) * 32, 0, 3);
      int4::block_bf16(packed + r * Kp / 2, blk, scale + r * groups, low + r * groups, out + r * 64);
    }
  }
  void load(int64_t s) const {
    if (s == 0) convert(0);
    if (s % 2 == 0 && s / 2 + 1 < (S + 1) / 2) convert(s / 2 + 1);
    const at::BFloat16* at = converted + s / 2 % 2 * kNB * 64 + s % 2 * kStep;
    _tile_loadd(4, at, 128);
    _tile_loadd(5, at + 16 * 64, 128);
  }
};

}  // namespace amx_rows

#endif  // AMX
