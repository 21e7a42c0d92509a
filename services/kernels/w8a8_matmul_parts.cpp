// w8a8 around torch's own int8 product (`torch._int_mm`: oneDNN's AMX-int8 or VNNI kernels): the rounding of x before
// it and the scaling after it, each one native pass — bit for bit linear_candidates._int8_dynamic_mm, which does the
// same in torch operators (w8a8_linear.cpp's legend: xs, xq, y).
//
// Legend: M rows of x, K columns, N output features; x [M, K] float32 / bf16 / fp16; xq [M, K] int8; xs [M, 1]
// float32; dots [M, N] int32 (exact); scale [N] float32; bias [N] in x's dtype or None; y [M, N] in x's dtype.
//
// Why: on an Intel Xeon with AMX (family 6 model 207, 2 threads) the product of 1,024 rows by a 16384 x 2048 W took
// 30 ms in `_int_mm`, and the torch operators around it ~50 ms more: five passes to round x (16 ms for 2 M values)
// and three over the 64 MB of int32 products (a float32 copy, the column scales, the conversion to bf16).
#pragma GCC optimize("fp-contract=off")  // float(dot) * xs * scale: two roundings, as torch's operators

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <tuple>
#include <type_traits>

#include "vec_load.h"

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

#include "row_rounding.h"  // round_row

namespace {

template <typename T>
void scale_rows(const int32_t* dots, const float* xs, const float* scale, const T* bias, T* y, int64_t M, int64_t N) {
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t* row = dots + m * N;
      T* out = y + m * N;
      const float s = xs[m];
      // rounded to the dtype, then the bias added and rounded again (torch adds it to the rounded y; in float32
      // the first rounding is none), each a loop of its own: no test per element, and no + 0 turning -0 into +0
      for (int64_t n = 0; n < N; ++n) out[n] = static_cast<T>(static_cast<float>(row[n]) * s * scale[n]);
      if (bias)
        for (int64_t n = 0; n < N; ++n) out[n] = static_cast<T>(static_cast<float>(out[n]) + static_cast<float>(bias[n]));
    }
  });
}

template <typename F>
void by_dtype(const torch::Tensor& x, const char* name, F&& run) {
  switch (x.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, name, ": x float32, bf16 or fp16");
  }
}

}  // namespace

// (xq, xs): each row of x rounded to int8 with its own scale.
std::tuple<torch::Tensor, torch::Tensor> w8a8_round_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "w8a8_round_rows: x [M, K]");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  torch::Tensor xs = torch::empty({M, 1}, x.options().dtype(torch::kFloat));
  by_dtype(xc, "w8a8_round_rows", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* rows = xc.data_ptr<T>();
    int8_t* q = xq.data_ptr<int8_t>();
    float* s = xs.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      int32_t sum;  // (the VNNI kernels' offset: not needed here)
      for (int64_t m = m0; m < m1; ++m) s[m] = round_row(rows + m * K, K, q + m * K, &sum);
    });
  });
  return {xq, xs};
}

// y from the int32 products, in `like`'s dtype: float(dots[m, n]) * xs[m] * scale[n] (+ bias).
torch::Tensor w8a8_scale_products(const torch::Tensor& dots, const torch::Tensor& xs, const torch::Tensor& scale,
                                  const c10::optional<torch::Tensor>& bias, const torch::Tensor& like) {
  TORCH_CHECK(dots.dim() == 2 && dots.scalar_type() == torch::kInt && dots.is_contiguous(),
              "w8a8_scale_products: dots int32 [M, N], contiguous");
  const int64_t M = dots.size(0), N = dots.size(1);
  TORCH_CHECK(xs.scalar_type() == torch::kFloat && xs.numel() == M && scale.scalar_type() == torch::kFloat &&
              scale.numel() == N, "w8a8_scale_products: xs float32 [M, 1], scale float32 [N]");
  TORCH_CHECK(!bias || (bias->scalar_type() == like.scalar_type() && bias->numel() == N),
              "w8a8_scale_products: bias [N] in x's dtype");
  const torch::Tensor xsc = xs.contiguous(), sc = scale.contiguous();
  const c10::optional<torch::Tensor> bc = bias ? c10::optional<torch::Tensor>(bias->contiguous()) : c10::nullopt;
  torch::Tensor y = torch::empty({M, N}, like.options());
  by_dtype(like, "w8a8_scale_products", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    scale_rows(dots.data_ptr<int32_t>(), xsc.data_ptr<float>(), sc.data_ptr<float>(), bc ? bc->data_ptr<T>() : nullptr,
               y.data_ptr<T>(), M, N);
  });
  return y;
}

#endif  // AVX-512 or AVX2
