// Where amx_linear.cpp's A tiles come from, one struct per weight format: load(s) puts step s's 32 W rows x 32 columns
// (bf16) into tiles 4 and 5. Shapes and the legend: amx_linear.cpp.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int4_block.h"
#include "tile_chunks.h"
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

// Quantized W (int8, int4): each 64-column chunk of the block's 32 rows converted to bf16 (tile_chunks.h: its two
// halves are steps 2c and 2c + 1, columns in the order ordered_tile_columns puts x in) one chunk ahead of its steps'
// tile loads, into the other half of `converted`: converted and loaded in the same step, 8 rows of 16384 x 2048 took
// 2.76 ms against 1.82 (separate runs of a noisy hour; a whole 32-row block converted at once, 128-512 KB, was slower
// still), as if a tile load waited on the stores of its own bytes. Format::convert(c, out) fills the chunk's halves.
template <typename Format>
struct ChunkRows {
  Format format;
  int64_t S;
  at::BFloat16* converted;  // [2 chunks, 2 halves, 32, 32]: chunks alternate

  at::BFloat16* chunk(int64_t c) const { return converted + c % 2 * 2 * kNB * kStep; }
  void load(int64_t s) const {
    if (s == 0) format.convert(0, chunk(0));
    if (s % 2 == 0 && s / 2 + 1 < (S + 1) / 2) format.convert(s / 2 + 1, chunk(s / 2 + 1));
    const at::BFloat16* at = chunk(s / 2) + s % 2 * kNB * kStep;
    _tile_loadd(4, at, 64);
    _tile_loadd(5, at + 16 * kStep, 64);
  }
};

// int8 W [32 rows, K]: exact (every int8 fits bf16's 8 bits)
struct Int8Chunks {
  const int8_t* w;  // the block's first row
  int64_t K;
  const int8_t* next;  // the next block's first row, nullptr where none (rows_ahead.h)
  const tile_chunks::Int8Table& table;

  void convert(int64_t c, at::BFloat16* out) const {
    const int8_t* at = w + c * 2 * kStep;
    const int64_t S = K / kStep;
    const int8_t* ahead = rows_ahead(w, next, 2 * c, kAhead, S, kStep);  // a line: the chunk
    const bool whole = 2 * c + 1 < S;  // else the last step's 32 columns (K % 64 == 32), in column order
    for (int64_t r = 0; r < kNB; ++r) {
      if (ahead) __builtin_prefetch(ahead + r * K, 0, 3);
      if (whole)
        tile_chunks::int8_chunk(table, at + r * K, out + r * kStep, out + (kNB + r) * kStep);
      else
        tile_chunks::int8_half(at + r * K, out + r * kStep);
    }
  }
};

// int4 W (group-wise, int4_block.h) [32 rows, Kp]: int4's prefill path's bf16 values (int4_dequantize)
struct Int4Chunks {
  const uint8_t* packed;  // the block's first row: [32, Kp / 2]
  const float *scale, *low;  // [32, Kp / 32] each, the block's group parameters as float32 (row_params)
  int64_t Kp, live;  // live: rows of the block within N (the others: zeros)

  void convert(int64_t c, at::BFloat16* out) const {
    const int64_t groups = Kp / int4::kGroup;
    for (int64_t r = 0; r < kNB; ++r) {
      if (r >= live) {
        std::memset(out + r * kStep, 0, kStep * sizeof(at::BFloat16));
        std::memset(out + (kNB + r) * kStep, 0, kStep * sizeof(at::BFloat16));
        continue;
      }
      __builtin_prefetch(packed + r * Kp / 2 + (c + 4) * 32, 0, 3);
      tile_chunks::int4_chunk(packed + r * Kp / 2, c, scale + r * groups, low + r * groups, out + r * kStep,
                              out + (kNB + r) * kStep);
    }
  }
};

}  // namespace amx_rows

#endif  // AMX
