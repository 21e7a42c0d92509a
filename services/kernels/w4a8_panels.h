// w4a8's weights in 16-row panels and its call, shared by w4a8_linear's two builds: w4a8_linear.cpp (AVX512-VNNI,
// vpdpbusd) and w4a8_avx2_linear.cpp (AVX2, vpmaddubsw + vpmaddwd); store_row is also int4_panel_linear.cpp's. Both
// builds compute, for every output, the same float32 chain in the same order from the same exact int32 group sums, so
// they give bit-identical results.
//
// Legend: M rows of x, K input features, N output features, G = 32 columns per group (W's and x's alike),
// Kp = K padded to whole 64-column blocks, P = ceil(N / 16) panels of 16 W rows.
//   x:      [M, K]          bfloat16 or float32; each group of 32 columns of a row rounded to int8:
//           s = max |x| / 127, x_q = round(x / s) * s (halves to even; an all-zero group stays zero)
//   packed: [P, Kp / 8, 16, 4] uint8 (services/w4a8_weight.py): panel p, column octet o, lane r (W row 16p + r),
//           byte i: q[16p + r, 8o + i] in the low nibble, q[16p + r, 8o + 4 + i] in the high one
//   scale, low: [P, Kp / G, 16] float16: w[n, k] = q[n, k] * scale + low of row n's group k / G, q in 0..15
//   y:      [M, N]          x's dtype
//   xq, xs, xz:             x rounded: int8 values, each group's s, and s * the group's sum of int8 values
//
// y[m, n] = sum over groups g of
//   scale[n, g] * s[m, g] * (sum_k q[n, k] * xi[m, k])  +  low[n, g] * s[m, g] * sum_k xi[m, k]
// where xi is x's int8 value; each output is acc = fma(low, z, fma(float(dot), scale * s, acc)) over g in order,
// then + bias, rounded once to y's dtype. The rounding of x is defined in services/kernels/w4a8_candidates.py
// (fake_quantize_groups), tested against both builds.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace w4a8 {

constexpr int64_t kGroup = 32, kPanel = 16;

struct GroupScale {
  float s, z;  // the group's step, and step * the sum of its int8 values
};

struct Panels {
  const uint8_t* packed;
  const at::Half *scale, *low;
  int64_t N, Kp, panels;
  const uint8_t* octet(int64_t p, int64_t o) const { return packed + (p * Kp / 8 + o) * 64; }
  const at::Half* group_scale(int64_t p, int64_t g) const { return scale + (p * Kp / kGroup + g) * kPanel; }
  const at::Half* group_low(int64_t p, int64_t g) const { return low + (p * Kp / kGroup + g) * kPanel; }
};

struct RoundedRows {  // x rounded, row-major
  std::vector<int8_t> q;  // [M, Kp]
  std::vector<float> s, z;  // [M, Kp / G]
};

// round_group(x row, K, k0, q [32]) -> GroupScale: the build's rounding of one group (zeros past K)
template <typename T, typename Round>
RoundedRows round_rows(const T* x, int64_t M, int64_t K, int64_t Kp, Round round_group) {
  RoundedRows r{std::vector<int8_t>(M * Kp, 0), std::vector<float>(M * Kp / kGroup, 0.f), {}};
  r.z.assign(r.s.size(), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
      const GroupScale g = round_group(x + m * K, K, k0, r.q.data() + m * Kp + k0);
      r.s[m * Kp / kGroup + k0 / kGroup] = g.s;
      r.z[m * Kp / kGroup + k0 / kGroup] = g.z;
    }
  return r;
}

// out [live] = sums [live] (+ bias [live]), rounded once to out's dtype
inline void store_row(const float* sums, const float* bias, int64_t live, float* out) {
  for (int64_t r = 0; r < live; ++r) out[r] = sums[r] + (bias ? bias[r] : 0.f);
}
inline void store_row(const float* sums, const float* bias, int64_t live, at::BFloat16* out) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  for (int64_t r = 0; r < live; r += 16) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, live - r)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(lanes, sums + r);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias + r));
    _mm256_mask_storeu_epi16(out + r, lanes, (__m256i)_mm512_cvtneps_pbh(v));
  }
#else
  for (int64_t r = 0; r < live; ++r) out[r] = static_cast<at::BFloat16>(sums[r] + (bias ? bias[r] : 0.f));
#endif
}

// The checks of a call and y; product(panels, x data, M, K, bias [N] float32 or nullptr, y data) fills y.
template <typename Product>
torch::Tensor call(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                   const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias, Product product) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a CPU [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  const int64_t panels = (N + kPanel - 1) / kPanel, K = x.size(1), Kp = (K + 63) / 64 * 64;
  TORCH_CHECK(N > 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu() &&
                  packed.numel() == panels * Kp * 8,
              "packed must be a contiguous CPU uint8 [ceil(N / 16), Kp / 8 * 64] for x's K");
  for (const auto* t : {&scale, &low})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == panels * Kp / kGroup * kPanel,
                "scale and low must be contiguous float16 [ceil(N / 16), Kp / 32 * 16]");
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have N elements");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  const Panels w{packed.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), low.data_ptr<at::Half>(), N, Kp, panels};
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({x.size(0), N}, xc.options());
  if (xc.scalar_type() == at::kBFloat16)
    product(w, xc.data_ptr<at::BFloat16>(), xc.size(0), K, b, y.data_ptr<at::BFloat16>());
  else
    product(w, xc.data_ptr<float>(), xc.size(0), K, b, y.data_ptr<float>());
  return y;
}

}  // namespace w4a8
