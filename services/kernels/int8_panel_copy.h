// The int8 panel copy (services/kernels/int8_panels.py) as its kernels check it: int8_panel_linear.cpp (products and
// W for prefill), int8_panel_bf16_linear.cpp, int8_panel_tiled_linear.cpp and pair_tiled_linear.cpp's
// int8_panel_pairs_linear; and (AVX512-BF16) an entry of it as two entries of bf16 pairs.
// Legend: N rows, K columns, K4 = ceil(K / 64) * 16 column quads, P = ceil(N / 16) panels.
//   panels: [P, K4, 16] int32, scale: [P * 16] float32
#pragma once

#include <torch/extension.h>

#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace int8_panels {

inline int64_t quads(int64_t K) { return (K + 63) / 64 * 16; }  // K4

// Refuses a copy that is not N x K's panels (and scales, where given) in the layout above.
inline void check_copy(const torch::Tensor& panels, const torch::Tensor* scale, int64_t N, int64_t K) {
  const int64_t P = (N + 15) / 16, K4 = quads(K);
  TORCH_CHECK(N > 0, "W must have rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kInt && panels.is_contiguous()
              && panels.device().is_cpu() && panels.size(0) == P && panels.size(1) == K4 && panels.size(2) == 16,
              "panels must be a contiguous CPU int32 [", P, ", ", K4, ", 16] for ", N, " x ", K, " W, got ",
              panels.sizes());
  TORCH_CHECK(!scale || (scale->dim() == 1 && scale->scalar_type() == at::kFloat && scale->is_contiguous()
                         && scale->device().is_cpu() && scale->size(0) == P * 16),
              "scale must be a contiguous CPU float32 [", P * 16, "]");
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// One entry (16 rows' quads, each byte w + 128) as bf16 pairs, exact (|w| <= 128 fits bf16's 8 bits): lane r of
// pair0 (W[r, 4j], W[r, 4j + 1]), of pair1 (W[r, 4j + 2], W[r, 4j + 3]) — two entries of bf16_panel_dots.h's layout.
inline void entry_pairs(const int32_t* entry, __m512i& pair0, __m512i& pair1) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // w + 128 -> w, as signed bytes
  // cvtne2ps_pbh(rows 4-7, rows 0-3) holds row r's quad as the pairs (c0, c1), (c2, c3) in lanes 2r, 2r + 1
  const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(1));
  const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(entry), flip);
  __m512 f[4];  // rows 4i .. 4i + 3's quads
  #pragma GCC unroll 4  // extracti32x4 takes an immediate
  for (int i = 0; i < 4; ++i) f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w, i)));
  const __m512i low = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), high = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
  pair0 = _mm512_permutex2var_epi32(low, first, high);
  pair1 = _mm512_permutex2var_epi32(low, second, high);
}
#endif

}  // namespace int8_panels
