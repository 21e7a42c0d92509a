// DecodeChain (decode_chain.cpp): a decode step's decoder layers in one native call, built once per model and row
// bucket from the kernel plan's choices.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

// One matrix product of the chain: a native kernel called directly, or ("call") the plan's Python candidate.
//   kernel "skinny":   tensors (w [N, D] dense or int8, scale [N] or None), options (rows, non_temporal, parts)
//          "int8_x16": tensors (w [N, D] int8, scale [N]), options (streams, non_temporal)      (AVX2 builds)
//          "int4", "int4_x16": tensors (packed, scale, low) of an Int4Weight, options (streams, non_temporal)
//          "int8_digits", "w8a8": tensors (w [N, D] int8, scale [N]), no options    (AVX512-VNNI or AVX2 builds)
//          "w8a8_row": tensors (w [N, D] int8, scale [N]), options (streams, non_temporal)  (AVX512-VNNI builds)
//          "w4a8":     tensors (packed, scale, low) of a W4A8Weight, options (out_features)  (AVX512-VNNI or AVX2 builds)
//          "int4_panels": tensors (packed, scale, low) of an Int4Weight's panel copy (int4_panels.py), options
//                      (out_features, streams, non_temporal)                                  (AVX512-BF16 builds)
//          "bf16_panels": tensors (panels) of a dense bf16 weight's panel copy (bf16_panels.py), options as
//                      int4_panels'                                                           (AVX512-BF16 builds)
//          "int8_panels": tensors (panels, scale) of a weight-only Int8Weight's panel copy (int8_panels.py),
//                      options as int4_panels'                                                (AVX512-VNNI builds)
//          "call":     call(x) -> y, the weight and bias bound in (no tensors, no options)
struct ChainProduct {
  ChainProduct(std::string kernel, std::vector<c10::optional<torch::Tensor>> tensors, c10::optional<torch::Tensor> bias,
               std::vector<int64_t> options, py::object call);
  torch::Tensor operator()(const torch::Tensor& x) const;

  enum class Kernel {
    kSkinny, kInt8X16, kInt4, kInt4X16, kInt8Digits, kW8a8, kW8a8Row, kW4a8, kInt4Panels, kBf16Panels, kInt8Panels,
    kCall
  } kernel;
  std::vector<c10::optional<torch::Tensor>> tensors;
  c10::optional<torch::Tensor> bias;
  std::vector<int64_t> options;
  py::object call;
};

class DecodeChain {
 public:
  DecodeChain(std::vector<ChainProduct> products, std::vector<torch::Tensor> post_norms,
              std::vector<torch::Tensor> next_norms, std::vector<c10::optional<torch::Tensor>> q_norms,
              std::vector<c10::optional<torch::Tensor>> k_norms, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps, double scale);
  torch::Tensor run(torch::Tensor h, torch::Tensor x, const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                    const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size,
                    const torch::Tensor& cos, const torch::Tensor& sin_signed) const;

 private:
  std::vector<ChainProduct> products_;  // 4 L: qkv, o, gate_up, down of each layer
  std::vector<torch::Tensor> post_norms_, next_norms_;  // L each
  std::vector<c10::optional<torch::Tensor>> q_norms_, k_norms_;  // L each, None without per-head norms
  int64_t H_, K_, Dh_;
  double eps_, scale_;
};
