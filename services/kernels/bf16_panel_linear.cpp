// Dense bf16 weights in 16-row panels (services/kernels/bf16_panels.py: a copy of the weight, made where the kernel
// plan chose this kernel, and then its only copy where it chose it for every row count), times bf16 x on CPUs with
// AVX512-BF16: y = x @ W^T (+ bias).
//
// Legend: M rows of x, K input features, K2 = ceil(K / 8) * 4 column pairs (K padded with zeros to a multiple of 8),
// N output features, P = ceil(N / 16) panels (the last one's missing rows zero).
//   x:      [M, K]          bfloat16
//   panels: [P, K2, 16]     int32: lane r of entry (p, j) holds the pair (W[16p + r, 2j], W[16p + r, 2j + 1])
//   bias:   [N]             optional, any float dtype (added in float32)
//   y:      [M, N]          bfloat16, float32 sums rounded once
//
// Why the panels: a panel's 64-byte entry is 16 rows' pairs of one column pair, so each vdpbf16ps takes one
// broadcast pair of x and the 16 rows' sums stay in the lanes (no reductions across lanes), and a panel is one
// contiguous stream. oneDNN's packed copy beat the row layout's kernels from 2 rows on and the row layout was what one
// row read fastest, so a bf16 weight was held twice; this layout is as fast as either at every row count (AMD EPYC
// Zen 4, 2 threads, weights cycled from memory, 16384 x 2048: 1 row 1.00 against the best row kernel's 1.02, 4 rows
// 2.31 against 2.50 ms, 32 rows 5.82 against oneDNN's 6.17, 1,024 rows 169 against 164; docs/kernels.md).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_panel_dots.h"
#include "panel_rows.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

using panel_rows::kPanel;

struct Dots {
  const int32_t* panels;
  const int32_t* x;  // [M, K2] bf16 pairs, zero past K
  int64_t K2;

  template <int MT, int S, int Locality>
  void run(int64_t p, int64_t apart, int64_t m0, float* sums) const {
    bf16_panel_dots::panel_dots<MT, S, Locality>(panels, p, apart, x + m0 * K2, K2, sums);
  }
};

}  // namespace

torch::Tensor bf16_panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                                const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal) {
  panel_rows::check_call(x, streams);
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 7) / 8 * 4, P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(N > 0, "W must have rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kInt && panels.is_contiguous() && panels.device().is_cpu()
              && panels.size(0) == P && panels.size(1) == K2 && panels.size(2) == kPanel,
              "panels must be a contiguous CPU int32 [", P, ", ", K2, ", 16] for ", N, " x ", K, " W, got ",
              panels.sizes());
  const torch::Tensor bias32 = panel_rows::float_bias(bias, N);
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const std::vector<at::BFloat16> xp = panel_rows::padded_x(x, 2 * K2);
  // several rows: two adjacent panels a pass (16 sums a vector load of x's 8 broadcasts), 1.02-1.08x faster at
  // 4-128 rows than one (AMD EPYC Zen 4, 2 threads)
  panel_rows::run<2>(Dots{panels.data_ptr<int32_t>(), reinterpret_cast<const int32_t*>(xp.data()), K2},
                     bias32, M, N, y.data_ptr<at::BFloat16>(), streams, non_temporal);
  return y;
}

#endif  // AVX512-BF16
