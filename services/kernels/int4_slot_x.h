// x as int4_linear.cpp's AVX512-BF16 loop reads it: in the block slots of int4_block.h (block_slot), with its group
// sums.
//
// Legend: M rows of x, K its columns, Kp = K padded to whole 64-column blocks, G = 32 columns per group.
//   x:     [M, K]       bf16
//   out.x: [M, Kp]      bf16, each block's columns in block_slot's order, zeros past K
//   xsum:  [M, Kp / G]  float32
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "int4_block.h"

#if defined(__AVX512BW__)
#include <immintrin.h>

namespace int4 {

// x [M, K] (bf16) as int4_linear's AVX512-BF16 loop reads it: x [M, Kp] in block_slot's order, zero past K (two
// vpermt2w a block), and xsum [M, Kp / G], its group sums in float32. Made here, not with torch's operators (pad,
// sum, index_select): those cost ~10 us a call, a sixth of a 3072 x 2048 product's time from memory.
struct SlotX {
  std::vector<at::BFloat16> x;
  std::vector<float> xsum;
};
inline SlotX slot_x(const torch::Tensor& x, int64_t Kp) {
  alignas(64) static const std::array<uint16_t, kBlock> slot_column = [] {  // register r's word w: its column
    std::array<uint16_t, kBlock> o{};
    for (int e = 0; e < kBlock; ++e) {
      int r, w;
      block_slot(e, r, w);
      o[32 * r + w] = static_cast<uint16_t>(e);
    }
    return o;
  }();
  const __m512i pick0 = _mm512_load_si512(slot_column.data()), pick1 = _mm512_load_si512(slot_column.data() + 32);
  const int64_t M = x.size(0), K = x.size(1), groups = Kp / kGroup;
  const torch::Tensor xc = x.contiguous();
  const at::BFloat16* xv = xc.data_ptr<at::BFloat16>();
  SlotX out{std::vector<at::BFloat16>(M * Kp), std::vector<float>(M * groups)};
  std::vector<at::BFloat16> row(Kp, at::BFloat16(0.f));  // one row, zeros past K
  auto as_float = [](__m256i words) {  // 16 bf16 -> float32: the top halves of the float32 bits
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
  };
  for (int64_t m = 0; m < M; ++m) {
    std::copy(xv + m * K, xv + (m + 1) * K, row.begin());
    for (int64_t b = 0; b < Kp / kBlock; ++b) {
      const __m512i cols0 = _mm512_loadu_si512(row.data() + b * kBlock);  // the block's columns 0..31, 32..63
      const __m512i cols1 = _mm512_loadu_si512(row.data() + b * kBlock + 32);
      at::BFloat16* to = out.x.data() + m * Kp + b * kBlock;
      _mm512_storeu_si512(to, _mm512_permutex2var_epi16(cols0, pick0, cols1));
      _mm512_storeu_si512(to + 32, _mm512_permutex2var_epi16(cols0, pick1, cols1));
      for (int g = 0; g < 2; ++g) {
        const __m512i cols = g ? cols1 : cols0;
        const __m512 both = _mm512_add_ps(as_float(_mm512_castsi512_si256(cols)),
                                          as_float(_mm512_extracti64x4_epi64(cols, 1)));
        out.xsum[m * groups + 2 * b + g] = _mm512_reduce_add_ps(both);
      }
    }
  }
  return out;
}

}  // namespace int4

#endif
