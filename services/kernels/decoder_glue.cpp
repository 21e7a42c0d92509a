// The element-wise glue between a decoder layer's products, one pass each instead of torch's chain
// of small operators (a decode step of the 1b preset ran ~300 of them, ~5 ms of an 80 ms step).
// Each computes exactly what Hugging Face's Llama computes in the tensor's dtype, rounding where it
// rounds; only the sum of squares is summed otherwise (in double, then rounded to float32).
//
// Legend: N rows (tokens), D hidden size, P heads rotated together, Dh head dim.
//   residual_rms_norm: h [N, D] (+= delta [N, D], rounded to h's dtype, in place), weight [D]
//                      -> weight * dtype(h32 * rsqrt(mean(h32^2) + eps)), h32 = float32(h): [N, D]
//   rotate_heads:      x [N, P, Dh] in place: x * cos + roll(x, Dh / 2) * sin_signed, each product and
//                      the sum rounded to x's dtype; cos, sin_signed [N, Dh] (sin_signed: -sin | sin).
//                      x's rows may be strided (the q and k heads of a fused qkv product's output).
// All tensors share one dtype (float32, bfloat16 or float16), contiguous except x's rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

// Every product rounded before the sum, as torch's separate operators round it: GCC would otherwise
// fuse a * c + b * s into one FMA (one rounding), and float32 results would differ in their last bit.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

// float32 -> T -> float32: the value a tensor of dtype T holds after storing v.
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void residual_rms_norm_rows(T* h, const T* delta, const T* weight, T* out, int64_t N, int64_t D, float eps) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      T* row = h + n * D;
      double sum_sq = 0.;  // in double: a float32 running sum over 2,048 squares drifts ~6 ulp from torch's tree sum
      for (int64_t d = 0; d < D; ++d) {
        const float v = delta ? rounded<T>(static_cast<float>(row[d]) + static_cast<float>(delta[n * D + d]))
                              : static_cast<float>(row[d]);
        if (delta) row[d] = static_cast<T>(v);
        sum_sq += static_cast<double>(v) * v;
      }
      const float inv_rms = 1.f / std::sqrt(static_cast<float>(sum_sq) / static_cast<float>(D) + eps);
      for (int64_t d = 0; d < D; ++d)
        out[n * D + d] = static_cast<T>(static_cast<float>(weight[d]) * rounded<T>(static_cast<float>(row[d]) * inv_rms));
    }
  });
}

template <typename T>
void rotate_rows(T* x, int64_t row_stride, const T* cos, const T* sin_signed, int64_t N, int64_t P, int64_t Dh) {
  const int64_t half = Dh / 2;
  at::parallel_for(0, N * P, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* head = x + (i / P) * row_stride + (i % P) * Dh;
      const T* c = cos + (i / P) * Dh;
      const T* s = sin_signed + (i / P) * Dh;
      for (int64_t d = 0; d < half; ++d) {  // the pair (d, d + half) reads each other: both computed first
        const float a = static_cast<float>(head[d]), b = static_cast<float>(head[d + half]);
        const float a_cos = rounded<T>(a * static_cast<float>(c[d]));  // one statement per product (clang
        const float b_sin = rounded<T>(b * static_cast<float>(s[d]));  // fuses only within an expression)
        const float b_cos = rounded<T>(b * static_cast<float>(c[d + half]));
        const float a_sin = rounded<T>(a * static_cast<float>(s[d + half]));
        head[d] = static_cast<T>(a_cos + b_sin);
        head[d + half] = static_cast<T>(b_cos + a_sin);
      }
    }
  });
}

void check_same(const torch::Tensor& a, const torch::Tensor& b, const char* what) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == b.scalar_type() && b.is_contiguous(),
              what, " must be contiguous CPU tensors of one dtype");
}

}  // namespace

torch::Tensor residual_rms_norm(torch::Tensor& h, const c10::optional<torch::Tensor>& delta,
                                const torch::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && weight.dim() == 1 && weight.size(0) == h.size(1), "h [N, D] and weight [D] expected");
  TORCH_CHECK(h.is_contiguous(), "h must be contiguous");
  check_same(h, weight, "h and weight");
  if (delta.has_value()) {
    check_same(h, *delta, "h and delta");
    TORCH_CHECK(delta->sizes() == h.sizes(), "delta must have h's shape");
  }
  const int64_t N = h.size(0), D = h.size(1);
  torch::Tensor out = torch::empty_like(h);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "residual_rms_norm", [&] {
    residual_rms_norm_rows(h.data_ptr<scalar_t>(), delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr,
                           weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), N, D, static_cast<float>(eps));
  });
  return out;
}

void rotate_heads(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x [N, P, Dh] with an even Dh expected");
  TORCH_CHECK(x.device().is_cpu() && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.stride(0) >= x.size(1) * x.size(2),
              "x must be a CPU tensor whose rows hold P whole heads each");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && sin_signed.sizes() == cos.sizes(),
              "cos and sin_signed [N, Dh] expected");
  check_same(x, cos, "x and cos");
  check_same(x, sin_signed, "x and sin_signed");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotate_heads", [&] {
    rotate_rows(x.data_ptr<scalar_t>(), x.stride(0), cos.data_ptr<scalar_t>(), sin_signed.data_ptr<scalar_t>(),
                x.size(0), x.size(1), x.size(2));
  });
}
