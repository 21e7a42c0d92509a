// Quantized (or bf16) weights times a batch of rows on CPUs with AVX512-BF16: y = x @ W^T (+ bias), every product
// by vdpbf16ps with float32 sums, W read from memory once per call whatever the number of rows.
//
// Legend: M rows of x, K input features, N output features, NR = 32 W rows per panel, KC = 128 columns per chunk,
// MR <= 8 rows of x per register tile, Kx = K rounded up to whole chunks.
//   x:      [M, K]        bfloat16 (other dtypes: not taken, see linear_candidates.py)
//   W:      [N, K] bfloat16; or int8 with scale [N] float32 (w_real[n, k] = w[n, k] * scale[n]); or group-wise int4
//           (packed [N, Kp / 2], scale and low [N, Kp / 32] float16: int4_block.h); or (int8_panel_pairs_linear)
//           int8 from its panel copy (int8_panels.py)
//   bias:   [N]           optional, x's dtype
//   y:      [M, N]        x's dtype, rounded once from the float32 sums
//   xs:     [M, Kx]       bf16, x with zeros past K: its 32-bit lanes are the pairs (x[m, 2j], x[m, 2j + 1])
//   rows:   [NR, KC]      bf16, per thread: one chunk of the panel's W rows (int8 exactly as integers, scaled at the
//           end; int4 dequantized and rounded to bf16, as int4's prefill path does), where W is rows (pair_sources.h)
//   panel:  [KC / 2, NR]  int32, per thread: lane n of entry j the pair (W[n, 2j], W[n, 2j + 1]) (pair_sources.h)
//   sums:   [M, NR]       float32, per thread: the panel's sums over the chunks so far
//
// Why: with several rows the streaming kernels convert each W element once per row (int8_x16, int4_linear) or read W
// once per 4 rows (skinny_linear), and the int4 tiles (int4_tiled_linear.cpp) sum dot products along K from L2: 32
// rows of x x the 1b preset's int8 matrices ran at 170-260 GFLOP/s, bf16 through oneDNN's packed weights at 265-330,
// on an AMD EPYC Zen 4 (2 threads). Here each W element is converted once per call, and the register tile
// (MR x 2 vectors of 16 sums) takes x as broadcast pairs against two panel vectors: 2 loads and MR broadcasts for 2 MR
// vdpbf16ps, no horizontal sums, the panel chunk (8 KB) and x's chunk in L1.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "int4_block.h"
#include "int8_panel_copy.h"
#include "pair_sources.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

using pair_sources::kKC;
using pair_sources::kNR;
constexpr int64_t kMR = 8;

// sums [MR, NR] (+)= x's tile . panel, x's tile [KC / 2, kMR] int32 pairs (xp's layout)
template <int MR>
inline void tile(const int32_t* xs, const int32_t* panel, bool first, float* sums) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + m * kNR + 16 * h);
  for (int64_t j = 0; j < kKC / 2; ++j) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + j * kNR);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + j * kNR + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xs[j * kMR + m]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(sums + m * kNR + 16 * h, acc[m][h]);
}

// every tile of x (one chunk of xp: [ceil(M / MR), KC / 2, MR]) times the panel
inline void tiles(const int32_t* xs, int64_t M, const int32_t* panel, bool first, float* sums) {
  for (int64_t m = 0; m < M; m += kMR, xs += kKC / 2 * kMR) {
    switch (std::min(kMR, M - m)) {
#define PDSERVE_MR_CASE(i) \
  case i: tile<i>(xs, panel, first, sums + m * kNR); break;
      PDSERVE_MR_CASE(1) PDSERVE_MR_CASE(2) PDSERVE_MR_CASE(3) PDSERVE_MR_CASE(4)
      PDSERVE_MR_CASE(5) PDSERVE_MR_CASE(6) PDSERVE_MR_CASE(7) default: PDSERVE_MR_CASE(8)
#undef PDSERVE_MR_CASE
    }
  }
}

// x [M, K] as xp [Kx / KC chunks, ceil(M / MR) tiles, KC / 2, MR] int32 pairs, zeros past K and past M: a tile's
// broadcasts read one stream (x's own rows, Kx / 2 int32 apart, alias in L1 at K = 2,048 and 8,192)
inline std::vector<int32_t> pack_x(const at::BFloat16* x, int64_t M, int64_t K, int64_t Kx) {
  const int64_t tiles = (M + kMR - 1) / kMR;
  std::vector<int32_t> xp(Kx / kKC * tiles * kKC / 2 * kMR, 0);
  std::vector<at::BFloat16> row(Kx, at::BFloat16(0.f));  // one row of x, zeros past K: Kx / 2 pairs
  const int32_t* pairs = reinterpret_cast<const int32_t*>(row.data());
  for (int64_t m = 0; m < M; ++m) {
    std::copy(x + m * K, x + (m + 1) * K, row.begin());
    for (int64_t chunk = 0; chunk < Kx / kKC; ++chunk) {
      int32_t* to = xp.data() + (chunk * tiles + m / kMR) * kKC / 2 * kMR + m % kMR;
      for (int64_t j = 0; j < kKC / 2; ++j) to[j * kMR] = pairs[chunk * kKC / 2 + j];
    }
  }
  return xp;
}

template <typename Source>
constexpr bool kFromPanels = std::is_same_v<Source, pair_sources::Int8PanelPairs>;  // else a row layout

// y [M, N] float32 = x @ W^T with W from `source` (pair_sources.h); xp: x packed (pack_x)
template <typename Source>
void product(const Source& source, const std::vector<int32_t>& xp, int64_t M, int64_t N, int64_t Kx, float* y) {
  const int64_t panels = (N + kNR - 1) / kNR, chunk_ints = (M + kMR - 1) / kMR * kKC / 2 * kMR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<at::BFloat16> rows(kNR * kKC);
    std::vector<int32_t> panel(kKC / 2 * kNR);
    std::vector<float> sums(M * kNR);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNR, live = std::min(kNR, N - n0);
      for (int64_t k0 = 0; k0 < Kx; k0 += kKC) {
        if constexpr (kFromPanels<Source>) {
          source.fill(n0, k0, panel.data());
        } else {
          for (int64_t r = 0; r < kNR; ++r) {
            if (r < live) source.row(n0 + r, k0, rows.data() + r * kKC);
            else std::fill(rows.data() + r * kKC, rows.data() + (r + 1) * kKC, at::BFloat16(0.f));
          }
          pair_sources::pack_panel(rows.data(), panel.data());
        }
        // the next chunk (this panel's, else the next panel's first) fetched while this one is multiplied: rows read
        // as 32 short streams were otherwise waited for, as long as the products took
        const int64_t next_k = k0 + kKC < Kx ? k0 + kKC : 0, next_n = k0 + kKC < Kx ? n0 : n0 + kNR;
        if (next_k > 0 || p + 1 < p1) {
          if constexpr (kFromPanels<Source>) source.fetch(next_n, next_k);
          else for (int64_t r = 0; r < kNR && next_n + r < N; ++r) source.fetch(next_n + r, next_k);
        }
        tiles(xp.data() + k0 / kKC * chunk_ints, M, panel.data(), k0 == 0, sums.data());
      }
      for (int64_t m = 0; m < M; ++m) std::copy(sums.data() + m * kNR, sums.data() + m * kNR + live, y + m * N + n0);
    }
  });
}

}  // namespace

// See the file's legend. Exactly one weight format: w (bf16 or int8, with scale for int8) or packed/scale/low (int4).
torch::Tensor pair_tiled_linear(const torch::Tensor& x, const c10::optional<torch::Tensor>& w,
                                const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& packed,
                                const c10::optional<torch::Tensor>& low, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be a CPU bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), Kx = (K + kKC - 1) / kKC * kKC;
  const torch::Tensor xc = x.contiguous();
  const std::vector<int32_t> xp = pack_x(xc.data_ptr<at::BFloat16>(), M, K, Kx);
  int64_t N;
  torch::Tensor y32;
  if (packed.has_value()) {
    TORCH_CHECK(scale.has_value() && low.has_value() && !w.has_value(), "int4: packed, scale and low");
    const int4::Int4Args a = int4::check_product(x, *packed, *scale, *low);
    N = a.N;
    y32 = torch::empty({M, N}, x.options().dtype(at::kFloat));
    const pair_sources::Int4Rows rows{packed->data_ptr<uint8_t>(), scale->data_ptr<at::Half>(),
                                      low->data_ptr<at::Half>(), K, a.Kp};
    product(rows, xp, M, N, Kx, y32.data_ptr<float>());
  } else {
    TORCH_CHECK(w.has_value() && w->dim() == 2 && w->size(1) == K && w->is_contiguous() && w->device().is_cpu(),
                "w must be a contiguous CPU [N, K]");
    N = w->size(0);
    y32 = torch::empty({M, N}, x.options().dtype(at::kFloat));
    if (w->scalar_type() == at::kChar) {
      TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->numel() == N,
                  "int8 needs scale [N] float32");
      product(pair_sources::Int8Rows{w->data_ptr<int8_t>(), K}, xp, M, N, Kx, y32.data_ptr<float>());
      y32.mul_(*scale);
    } else {
      TORCH_CHECK(w->scalar_type() == at::kBFloat16 && !scale.has_value(), "w must be bf16, or int8 with scale");
      product(pair_sources::Bf16Rows{w->data_ptr<at::BFloat16>(), K}, xp, M, N, Kx, y32.data_ptr<float>());
    }
  }
  if (bias.has_value()) y32.add_(bias->to(at::kFloat));
  return y32.to(at::kBFloat16);
}

// The same product for weight-only int8 from its panel copy (int8_panels.py: panels [P, K4, 16] int32, scale
// [P * 16] float32): pair_tiled_linear's on the weight's rows, bit for bit, with no rows read.
torch::Tensor int8_panel_pairs_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                      int64_t N, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be a CPU bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), Kx = (K + kKC - 1) / kKC * kKC, K4 = int8_panels::quads(K);
  const int64_t P = (N + 15) / 16;
  TORCH_CHECK(K > 0, "W must have columns");
  int8_panels::check_copy(panels, &scale, N, K);
  const torch::Tensor xc = x.contiguous();
  const std::vector<int32_t> xp = pack_x(xc.data_ptr<at::BFloat16>(), M, K, Kx);
  torch::Tensor y32 = torch::empty({M, N}, x.options().dtype(at::kFloat));
  product(pair_sources::Int8PanelPairs{panels.data_ptr<int32_t>(), P, K4}, xp, M, N, Kx, y32.data_ptr<float>());
  y32.mul_(scale.slice(0, 0, N));
  if (bias.has_value()) y32.add_(bias->to(at::kFloat));
  return y32.to(at::kBFloat16);
}

#endif  // AVX512-BF16
