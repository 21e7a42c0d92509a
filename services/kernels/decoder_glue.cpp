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
//   silu_mul:          gate_up [N, 2F] -> silu(gate) * up [N, F], gate = gate_up[:, :F], up = the rest (AVX-512
//                      BW/VL or AVX2 builds); silu rounded to the dtype, then the product rounded, as torch's
//                      F.silu(gate) * up. silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below, e = e^-|g| from
//                      softmax_math.h's polynomial (~1e-7 from torch's Sleef exp, far below a 16-bit step: of
//                      1,024 x 8,192 N(0, 1) bf16 gates none came out otherwise). Why: after a decode product has
//                      streamed its weight through the caches, torch's two operators on one 8,192-wide row took
//                      ~57-130 us (their code and data fetched anew); this pass a half to a sixth of that.
// The norm and silu_mul run on GlueLanes (glue_lanes.h: 16 or 8 float32 lanes) where the build has them: the
// scalar norm, one row at a time, took twice torch's time for a 1,024-row prefill (AVX2 Zen 3).
// All tensors share one dtype (float32, bfloat16 or float16), contiguous except x's rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "glue_lanes.h"

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

// One row: h (+= delta, rounded to T) and out = weight * T(h * inv_rms), inv_rms = 1 / sqrt(mean(h^2) + eps); the
// squares summed in double (a float32 running sum over 2,048 squares drifts ~6 ulp from torch's tree sum).
template <typename T>
void residual_rms_norm_row(T* row, const T* delta, const T* weight, T* out, int64_t D, float eps) {
  int64_t d = 0;
  double sum_sq = 0.;
#if defined(PDSERVE_GLUE_LANES)
  using Lanes = GlueLanes;
  constexpr bool kVector = !std::is_same_v<T, double>;  // float64 (dispatched too) keeps the scalar loop
  typename Lanes::Sum sums = Lanes::no_sum();
  if constexpr (kVector) for (; d < D; d += Lanes::kLanes) {  // lanes past the row's end load as 0: they add no square
    const int64_t count = std::min<int64_t>(Lanes::kLanes, D - d);
    typename Lanes::V v = Lanes::load(row + d, count);
    if (delta) {
      v = Lanes::round_to(Lanes::add(v, Lanes::load(delta + d, count)), static_cast<T*>(nullptr));
      Lanes::store(row + d, v, count);
    }
    sums = Lanes::square_sum(sums, v);
  }
  if constexpr (kVector) sum_sq = Lanes::total(sums);
#endif
  for (; d < D; ++d) {  // without the lanes: the whole row
    const float v = delta ? rounded<T>(static_cast<float>(row[d]) + static_cast<float>(delta[d])) : static_cast<float>(row[d]);
    if (delta) row[d] = static_cast<T>(v);
    sum_sq += static_cast<double>(v) * v;
  }
  const float inv_rms = 1.f / std::sqrt(static_cast<float>(sum_sq) / static_cast<float>(D) + eps);
  d = 0;
#if defined(PDSERVE_GLUE_LANES)
  if constexpr (kVector) for (; d < D; d += Lanes::kLanes) {
    const int64_t count = std::min<int64_t>(Lanes::kLanes, D - d);
    const typename Lanes::V normed = Lanes::round_to(Lanes::mul(Lanes::load(row + d, count), Lanes::set1(inv_rms)),
                                                     static_cast<T*>(nullptr));
    Lanes::store(out + d, Lanes::round_to(Lanes::mul(Lanes::load(weight + d, count), normed), static_cast<T*>(nullptr)),
                 count);
  }
#endif
  for (; d < D; ++d)
    out[d] = static_cast<T>(static_cast<float>(weight[d]) * rounded<T>(static_cast<float>(row[d]) * inv_rms));
}

template <typename T>
void residual_rms_norm_rows(T* h, const T* delta, const T* weight, T* out, int64_t N, int64_t D, float eps) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      residual_rms_norm_row(h + n * D, delta ? delta + n * D : nullptr, weight, out + n * D, D, eps);
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

#if defined(PDSERVE_GLUE_LANES)
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t N, int64_t F) {
  constexpr int kLanes = GlueLanes::kLanes;
  at::parallel_for(0, N * F, 1024, [&](int64_t begin, int64_t end) {  // flat [N, F] positions
    for (int64_t i = begin; i < end;) {
      const int64_t n = i / F, f = i % F, run = std::min(end - i, F - f);  // along one row
      const T* gate = gate_up + n * 2 * F + f;
      T* y = out + i;
      for (int64_t k = 0; k < run; k += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, run - k);
        GlueLanes::store(y + k, GlueLanes::silu_times<T>(GlueLanes::load(gate + k, count),
                                                         GlueLanes::load(gate + F + k, count)), count);
      }
      i += run;
    }
  });
}
#endif

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

#if defined(PDSERVE_GLUE_LANES)
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() && gate_up.device().is_cpu(),
              "gate_up must be a contiguous CPU [N, 2F] tensor");
  const int64_t N = gate_up.size(0), F = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({N, F}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), N, F); break;
    case at::kBFloat16: silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), N, F); break;
    case at::kHalf: silu_mul_rows(gate_up.data_ptr<at::Half>(), out.data_ptr<at::Half>(), N, F); break;
    default: TORCH_CHECK(false, "silu_mul takes float32, bfloat16 or float16, not ", gate_up.scalar_type());
  }
  return out;
}
#endif
