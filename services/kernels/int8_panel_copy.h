// The int8 panel copy (services/kernels/int8_panels.py) as its kernels check it: int8_panel_linear.cpp (products and
// W for prefill), int8_panel_bf16_linear.cpp and pair_tiled_linear.cpp's int8_panel_pairs_linear.
// Legend: N rows, K columns, K4 = ceil(K / 64) * 16 column quads, P = ceil(N / 16) panels.
//   panels: [P, K4, 16] int32, scale: [P * 16] float32
#pragma once

#include <torch/extension.h>

#include <cstdint>

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

}  // namespace int8_panels
