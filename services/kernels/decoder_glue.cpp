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
//   silu_mul (AVX-512 BW/VL builds): gate_up [N, 2F] -> silu(gate) * up [N, F], gate = gate_up[:, :F], up = the rest;
//                      silu rounded to the dtype, then the product rounded, as torch's F.silu(gate) * up. silu(g) =
//                      g / (1 + e) for g >= 0, g e / (1 + e) below, e = e^-|g| from softmax_math.h's polynomial
//                      (~1e-7 from torch's Sleef exp, far below a 16-bit step: of 1,024 x 8,192 N(0, 1) bf16
//                      gates none came out otherwise). Why: after a decode product has streamed its weight through
//                      the caches, torch's two operators on one 8,192-wide row took ~57 us (their code and data
//                      fetched anew), ~1 ms of a 1b step; this pass 21 us (and 3.1 ms against 5.8 for 1,024 rows).
// All tensors share one dtype (float32, bfloat16 or float16), contiguous except x's rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "softmax_math.h"
#include "vec_load.h"

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

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// v rounded to T (round to nearest even, as torch converts), still as float32; and stored as T.
inline __m512 round_to(__m512 v, float*) { return v; }
inline __m512 round_to(__m512 v, at::BFloat16*) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 round_to(__m512 v, at::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(float* p, __m512 rounded, __mmask16 lanes) { _mm512_mask_storeu_ps(p, lanes, rounded); }
inline void store16(at::BFloat16* p, __m512 rounded, __mmask16 lanes) {  // the top halves, exact
  _mm256_mask_storeu_epi16(p, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
inline void store16(at::Half* p, __m512 rounded, __mmask16 lanes) {
  _mm256_mask_storeu_epi16(p, lanes, _mm512_cvtps_ph(rounded, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline __m512 load_lanes(const T* p, __mmask16 lanes) {  // 16 elements (those past `lanes` read as 0)
  if (lanes == 0xFFFF) return load16(p);
  alignas(64) T tail[16] = {};
  for (int i = 0; i < 16; ++i)
    if (lanes >> i & 1) tail[i] = p[i];
  return load16(tail);
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t N, int64_t F) {
  at::parallel_for(0, N * F, 1024, [&](int64_t begin, int64_t end) {  // flat [N, F] positions
    const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
    for (int64_t i = begin; i < end;) {
      const int64_t n = i / F, f = i % F, run = std::min(end - i, F - f);  // along one row
      const T* gate = gate_up + n * 2 * F + f;
      T* y = out + i;
      for (int64_t k = 0; k < run; k += 16) {
        const __mmask16 lanes = run - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (run - k)) - 1);
        const __m512 g = load_lanes(gate + k, lanes), u = load_lanes(gate + F + k, lanes);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
        const __m512 numerator = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ), g, e);
        const __m512 silu = round_to(_mm512_div_ps(numerator, _mm512_add_ps(one, e)), static_cast<T*>(nullptr));
        store16(y + k, round_to(_mm512_mul_ps(silu, u), static_cast<T*>(nullptr)), lanes);
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

#if defined(__AVX512BW__) && defined(__AVX512VL__)
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
