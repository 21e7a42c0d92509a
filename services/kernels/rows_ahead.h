// Where the tile kernels fetch a block's W rows some steps ahead (amx_rows.h's rows for amx_linear.cpp, and
// amx_w8a8_linear.cpp): each block is 32 rows K elements apart, read `step` elements a step, S steps a row.
//
// Why: fetched only within its own rows, a block's last steps fetched nothing of use (the bytes past a row's end are
// the next row's first, read long before) and the next block's first steps waited on memory, once a block — every
// 64 KB of an int8 W with K = 2,048. Fetching the next block's first steps instead, 32 rows of 16384 x 2048 from
// memory, old and new builds alternated three times: w8a8 1.27-1.33 -> 1.15-1.20 ms, bf16 2.22-2.25 -> 2.15-2.17
// (Intel Xeon, family 6 model 207, 2 threads).
#pragma once

#include <cstdint>

// Step s + ahead of the block whose first row is w; past its rows' end, step s + ahead - S of the next block's
// (next: that block's first row; nullptr where no whole block follows: nothing to fetch).
template <typename T>
inline const T* rows_ahead(const T* w, const T* next, int64_t s, int64_t ahead, int64_t S, int64_t step) {
  const int64_t target = s + ahead;
  if (target < S) return w + target * step;
  return next ? next + (target - S) * step : nullptr;
}

// The first row of the block after the one starting at row n0 of w [N, K] (blocks of nb rows), where that block is
// whole; nullptr where none follows (a last, partial block is read from a zero-padded copy: nothing to fetch there).
template <typename T>
inline const T* next_block(const T* w, int64_t n0, int64_t nb, int64_t N, int64_t K) {
  return n0 + 2 * nb <= N ? w + (n0 + nb) * K : nullptr;
}
