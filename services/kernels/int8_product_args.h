// The arguments of the int8-weight products that take (x, w, scale, bias) (amx_w8a8_linear.cpp, int8_digits_linear.cpp),
// checked once for both: x [M, K] on the CPU (made contiguous), w [N, K] contiguous int8, scale [N] float32, bias [N]
// or none (in x's dtype), y [M, N] allocated in x's dtype. Each product checks its own rule for K.
#pragma once

#include <torch/extension.h>

struct Int8ProductArgs {
  torch::Tensor x, bias, y;  // bias undefined where there is none
  int64_t M, K, N;
};

inline Int8ProductArgs int8_product_args(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                         const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a CPU [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous CPU int8 [N, K]");
  Int8ProductArgs a{x.contiguous(), {}, {}, x.size(0), x.size(1), w.size(0)};
  TORCH_CHECK(w.size(1) == a.K, "x and w must share K");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == a.N,
              "scale must be a contiguous float32 [N]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == a.N, "bias must have N elements");
    a.bias = bias->to(a.x.scalar_type()).contiguous();
  }
  a.y = torch::empty({a.M, a.N}, a.x.options());
  return a;
}
