// The prefill attention's two products (prefill_attention.cpp: s = q k^T, o += p v) on the tile unit of CPUs with AMX,
// taking pair_gemm.h's operands as they are: a row-major bf16, b packed in bf16 pairs, which is the layout tdpbf16ps
// reads for its B operand.
//
// Legend: rows of a and c, cols of b and c (a multiple of 16), steps pairs of the shared dim (a multiple of 16).
//   a: [rows, 2 steps] bf16, rows lda apart        tiles 4, 5: 16 rows x 16 pairs, two row tiles
//   b: [steps, ldb / 2 >= cols, 2] bf16            tiles 6, 7: 16 pairs x 16 columns, two column tiles
//   c: [rows, cols] float32, rows ldc apart        tiles 0-3: the 2 x 2 row and column tiles' sums
//
// Why: on an Intel Xeon with AMX (family 6 model 207, 2 threads) the vdpbf16ps register tiles ran a 1,024-token
// prefill layer of the `1b` shapes at ~100 GFLOP/s and torch's SDPA at ~220, against ~1-2 TFLOP/s for the tile unit's
// products: the attention was a fifth to a third of the `1b` prefill.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define PDSERVE_PREFILL_TILES 1
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "tile_state.h"

namespace prefill_tiles {

// A process-wide switch (set_prefill_attention_tiles), so tests and benchmarks compare both paths in one process.
inline std::atomic<bool> on{true};

inline bool supports(int64_t Dh) { return on && Dh % 32 == 0 && tile_state::granted(); }

// One thread's products, in a row: the tile shapes change only with the row tiles' heights, loaded when they do. The
// tiles are the thread's own state until release (each kernel loads its own shapes per call).
class Gemm {
 public:
  ~Gemm() {
    if (ra_ >= 0) _tile_release();
  }

  // c (+)= a . b as pair_gemm::gemm computes it (add: c's values summed into), float32 sums of exact bf16 products.
  void operator()(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t ldb, int64_t steps, float* c,
                  int64_t ldc, int64_t rows, int64_t cols, bool add) {
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
      const int64_t ra = std::min<int64_t>(16, rows - r0), rb = std::clamp<int64_t>(rows - r0 - 16, 0, 16);
      shape(ra, rb);
      const at::BFloat16 *a0 = a + r0 * lda, *a1 = a0 + 16 * lda;
      for (int64_t c0 = 0; c0 < cols; c0 += 32) {
        const bool right = c0 + 16 < cols;  // a second column tile
        float* c00 = c + r0 * ldc + c0;
        float* c10 = c00 + 16 * ldc;
        if (add) {
          _tile_loadd(0, c00, ldc * 4);
          if (right) _tile_loadd(1, c00 + 16, ldc * 4);
          if (rb > 0) _tile_loadd(2, c10, ldc * 4);
          if (rb > 0 && right) _tile_loadd(3, c10 + 16, ldc * 4);
        } else {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t s = 0; s < steps; s += 16) {
          const at::BFloat16* bs = b + s * ldb + 2 * c0;
          _tile_loadd(4, a0 + 2 * s, lda * 2);
          _tile_loadd(6, bs, ldb * 2);
          _tile_dpbf16ps(0, 4, 6);
          if (right) {
            _tile_loadd(7, bs + 32, ldb * 2);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (rb > 0) {
            _tile_loadd(5, a1 + 2 * s, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (right) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c00, ldc * 4);
        if (right) _tile_stored(1, c00 + 16, ldc * 4);
        if (rb > 0) _tile_stored(2, c10, ldc * 4);
        if (rb > 0 && right) _tile_stored(3, c10 + 16, ldc * 4);
      }
    }
  }

 private:
  int64_t ra_ = -1, rb_ = -1;  // the loaded shapes' row tile heights (-1: none loaded)

  void shape(int64_t ra, int64_t rb) {
    if (ra == ra_ && rb == rb_) return;
    const int64_t lower = std::max<int64_t>(rb, 1);  // an unused lower row tile keeps a valid shape
    tile_state::Config()
        .tile(0, ra, 64).tile(1, ra, 64).tile(2, lower, 64).tile(3, lower, 64)
        .tile(4, ra, 64).tile(5, lower, 64).tile(6, 16, 64).tile(7, 16, 64)
        .load();
    ra_ = ra, rb_ = rb;
  }
};

}  // namespace prefill_tiles

#endif  // AMX
