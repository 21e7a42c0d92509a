// Quantized weights from their 16-row panel copies times many rows of bf16 x (a prefill, a large batch) on CPUs with
// AVX512-BF16: y = x @ W^T (+ bias), pair_tiled_linear's product on the weight's rows (`native.pairs`) bit for bit.
//
// Legend: M rows of x, K input features, Kp = K rounded up to 64, K2 = Kp / 2 column pairs, N output features,
// P = ceil(N / 16) panels.
//   x:      [M, K]       bfloat16 -> xp [M, K2] int32 bf16 pairs, zeros past K
//   int8 (int8_panels.py, weight-only): panels [P, Kp / 4, 16] int32 (lane r of entry (p, j): W[16p + r, 4j .. 4j + 3]
//           + 128 as four unsigned bytes), scale [P * 16] float32: w_real[n, k] = w[n, k] * scale[n]
//   int4 (int4_panels.py): packed [P, Kp / 8, 64] uint8, scale / low [P, Kp / 32, 16] float16: w = q * scale + low
//           rounded to bf16, as int4's prefill path and the pair tiles dequantize it
//   pairs:  [2, K2, 16]  int32, per thread: the two panels of its current pass as bf16 pairs (bf16_panel_dots.h)
//   y:      [M, N]       bfloat16, each float32 sum (int8: times scale) (+ bias) rounded once
//
// Why: a prefill from a copy went through its dequantize kernel + torch's bf16 product (W written out as bf16, then
// reordered by oneDNN in every call) or the pair tiles, whose sums for all M rows leave the registers at every
// 128-column chunk: 1,024 rows of an int8 16384 x 2048 took 189 and 206 ms where the bf16 panels take 170 (AMD EPYC
// Zen 4, 2 threads). Here each thread converts two panels into bf16 pairs once — 64-512 KB that stay in its L2 — and
// runs the bf16 panels' register tiles over every row of x against them, the sums in registers over all of K: 171 ms.
// One chain per sum, in the order of the column pairs as the pair tiles sum, so the result is theirs bit for bit.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_panel_dots.h"
#include "int4_panel_octets.h"
#include "int8_panel_copy.h"
#include "panel_rows.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

using panel_rows::kPanel;

// Panel p as bf16 pairs into pairs [K2, 16], for each copy's format.
struct Int8Panels {
  const int32_t* panels;
  const float* scale;
  int64_t K2;
  void convert(int64_t p, int32_t* pairs) const {
    for (int64_t j = 0; j < K2 / 2; ++j) {  // an entry (a column quad): two pairs
      __m512i pair0, pair1;
      int8_panels::entry_pairs(panels + (p * K2 / 2 + j) * kPanel, pair0, pair1);
      _mm512_storeu_si512(pairs + 2 * j * kPanel, pair0);
      _mm512_storeu_si512(pairs + (2 * j + 1) * kPanel, pair1);
    }
  }
  const float* scales(int64_t p) const { return scale + p * kPanel; }
};

struct Int4Panels {
  const uint8_t* packed;
  const at::Half *scale, *low;
  int64_t K2;
  void convert(int64_t p, int32_t* pairs) const {
    for (int64_t g = 0; g < K2 / 16; ++g) {  // a group: 16 pairs
      __m512i group[16];
      int4_panels::group_pairs(packed, scale, low, p, g, 2 * K2, group);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(pairs + (16 * g + j) * kPanel, group[j]);
    }
  }
  const float* scales(int64_t) const { return nullptr; }  // dequantized already
};

// this thread's converted panels: one buffer for every tile size (a thread_local in run would be one per MT)
std::vector<int32_t>& thread_pairs() {
  thread_local std::vector<int32_t> pairs;
  return pairs;
}

template <typename Copy>
struct ConvertedDots {
  Copy copy;
  const int32_t* x;  // xp

  // panel_rows' passes take one panel (pair) at a time, its tiles of x in order (m0 = 0 first) on one thread
  template <int MT, int S, int Locality>
  void run(int64_t p, int64_t apart, int64_t m0, float* sums) const {
    const int64_t K2 = copy.K2;
    std::vector<int32_t>& pairs = thread_pairs();
    if (m0 == 0) {
      pairs.resize(S * K2 * kPanel);
      for (int s = 0; s < S; ++s) copy.convert(p + s * apart, pairs.data() + s * K2 * kPanel);
    }
    bf16_panel_dots::panel_dots<MT, S, Locality, 1>(pairs.data(), 0, 1, x + m0 * K2, K2, sums);
    for (int s = 0; s < S; ++s)
      if (const float* scale = copy.scales(p + s * apart)) {
        const __m512 sc = _mm512_loadu_ps(scale);
        for (int m = 0; m < MT; ++m) {
          float* out = sums + (s * MT + m) * kPanel;
          _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_loadu_ps(out), sc));
        }
      }
  }
};

template <typename Copy>
torch::Tensor product(const torch::Tensor& x, const Copy& copy, int64_t N, const c10::optional<torch::Tensor>& bias) {
  const torch::Tensor bias32 = panel_rows::float_bias(bias, N);
  torch::Tensor y = torch::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
  const std::vector<at::BFloat16> xp = panel_rows::padded_x(x, 2 * copy.K2);  // Kp columns
  // two adjacent panels a pass, as bf16_panel_linear's several rows
  panel_rows::run<2>(ConvertedDots<Copy>{copy, reinterpret_cast<const int32_t*>(xp.data())}, bias32, x.size(0), N,
                     y.data_ptr<at::BFloat16>(), 1, false);
  return y;
}

}  // namespace

// See the file's legend: weight-only int8 from its panel copy.
torch::Tensor int8_panel_tiled_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                      int64_t N, const c10::optional<torch::Tensor>& bias) {
  panel_rows::check_call(x, 1);
  int8_panels::check_copy(panels, &scale, N, x.size(1));
  const Int8Panels copy{panels.data_ptr<int32_t>(), scale.data_ptr<float>(), 2 * int8_panels::quads(x.size(1))};
  return product(x, copy, N, bias);
}

// See the file's legend: group-wise int4 from its panel copy.
torch::Tensor int4_panel_tiled_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                                      const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias) {
  panel_rows::check_call(x, 1);
  const int64_t Kp = (x.size(1) + 63) / 64 * 64;
  int4_panels::check_copy(packed, scale, low, N, Kp);
  const Int4Panels copy{packed.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), low.data_ptr<at::Half>(), Kp / 2};
  return product(x, copy, N, bias);
}

#endif  // AVX512-BF16
