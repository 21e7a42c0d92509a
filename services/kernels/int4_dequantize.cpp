// Group-wise int4 weights (services/int4_weight.py) dequantized whole, for prefill's dense product over many rows.
//
// Legend: N output features, Kp = K padded to whole 64-column blocks, G = 32 columns per group.
//   packed, scale, low: as in int4_block.h (w[n, k] = q * scale[n, k/G] + low[n, k/G])
//   out:    [N, in_features]  float32 / bfloat16 / float16, in_features within the last block

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "int4_block.h"

using namespace int4;

torch::Tensor int4_dequantize(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low,
                              torch::Tensor out) {
  // -> out [N, in_features] (float32 / bfloat16 / float16), for a dense product over many rows (prefill).
  // The caller's buffer, reused: a fresh 64 MB result is a fresh mapping whose pages fault in (dequant_buffer.py)
  const Int4Args w = check(packed, scale, low);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.device().is_cpu() && out.size(0) == w.N,
              "out must be a contiguous CPU [N, in_features] tensor");
  const int64_t in_features = out.size(1);
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(in_features <= w.Kp && in_features > w.Kp - kBlock, "in_features must lie in the last 64-column block");
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* lo = low.data_ptr<at::Half>();
  auto run = [&](auto* o) {
    at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
      std::vector<float> sc(w.groups), lw(w.groups), row(w.Kp);
      for (int64_t n = n0; n < n1; ++n) {
        row_params(s + n * w.groups, lo + n * w.groups, w.groups, sc.data(), lw.data());
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if constexpr (std::is_same_v<decltype(o), at::BFloat16*>) {  // by each group's 16 values (block_bf16)
          alignas(64) at::BFloat16 last[kBlock];
          for (int64_t b = 0; b < w.Kp / kBlock; ++b) {
            const int64_t k0 = b * kBlock, width = std::min(kBlock, in_features - k0);
            block_bf16(q + n * w.Kp / 2, b, sc.data(), lw.data(), width == kBlock ? o + n * in_features + k0 : last);
            if (width < kBlock) std::copy(last, last + width, o + n * in_features + k0);
          }
          continue;
        }
#endif
        dequantize_row(q + n * w.Kp / 2, sc.data(), lw.data(), w.Kp, row.data());
        store_row(row.data(), o + n * in_features, in_features);
      }
    });
  };
  switch (dtype) {
    case at::kFloat: run(out.data_ptr<float>()); break;
    case at::kBFloat16: run(out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(out.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "int4 dequantizes to float32, bfloat16 or float16, not ", dtype);
  }
  return out;
}
