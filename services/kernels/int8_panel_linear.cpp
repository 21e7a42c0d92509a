// Per-channel int8 weights (weight-only int8) in 16-row panels (services/kernels/int8_panels.py: a copy of the
// weight, made where the kernel plan chose this kernel and kept beside its rows), times bf16 x in 21-bit fixed point
// on CPUs with AVX512-VNNI: x's rows as three int8 digit rows each (x_digits.h), multiplied by the panels' bytes
// exactly in int32, the three dots joined exactly in int64, then one float conversion, x's unit and W's scale —
// int8_digits_linear.cpp's product bit for bit, from another layout.
//
// Legend: M rows of x, K input features (<= 65,536: the dots stay in int32), Kp = K rounded up to 64, K4 = Kp / 4
// column quads, N output features, P = ceil(N / 16) panels (the last one's missing rows zero), R = 3M digit rows.
//   x:      [M, K]       bfloat16 -> digits q [R, Kp] int8, units u [M], digit sums [R] (x_digits.h)
//   quads:  [tiles, K4, 3T] int32: q's quads, a tile of T = min(M, kTile) x rows' 3T digit rows interleaved quad by
//                        quad (a short last tile padded with zeros)
//   panels: [P, K4, 16]  int32: lane r of entry (p, j) holds W[16p + r, 4j .. 4j + 3] + 128 as four unsigned bytes
//   scale:  [P * 16]     float32: w[n, k] ~= W[n, k] * scale[n] (past N: unused);  bias [N] or none
//   y:      [M, N]       bfloat16: D = sum_k X[m, k] W[n, k] (int64, exact), y = float(D) * u[m] * scale[n] (+ bias),
//                        rounded once
//
// Why the panels: the row layout's kernels read a weight as 4 or more row streams at once and sum each row's dots
// across a vector's lanes; here a 64-byte entry is 16 rows' quads of one column quad, so each vpdpbusd takes one
// broadcast quad of a digit row, the 16 rows' dots stay in the lanes, and a panel is one contiguous stream, as
// bf16_panel_linear.cpp's are; one W load serves the pass's digit rows. One x row, AMD EPYC Zen 4, 2 threads, weights
// cycled from memory: 1.15-1.28x faster than the row layout's best kernel on the `1b` shapes; at 4-32 rows 0.9-1.2x
// its time (docs/kernels.md), so the rows stay (int8_panels.py).
#pragma GCC optimize("fp-contract=off")  // float(D) * u * scale, then + bias: each rounded as written

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_panel_copy.h"
#include "panel_rows.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)

#include "x_digits.h"  // XDigits, digit_rows

namespace {

using panel_rows::kPanel;
constexpr int64_t kStep = 64, kOffset = 128;
constexpr int64_t kTile = 4;  // x rows a pass over a panel: 12 digit rows' accumulators (8 rows' 24 spilled: 2x slower)
constexpr int64_t kAheadBytes = 1024;  // prefetch distance in all (each of S streams: 1 / S of it)

// acc += u (unsigned bytes) . the broadcast quad at `quad` (signed). The intrinsic, not int8_dot_tiles.h's asm: here
// GCC 12 kept the asm's accumulators in memory in the one-row loops (2.2x slower from L3), and the intrinsic's copies
// cost little with at most 12 accumulators (Tile 4)
inline void dpbusd(__m512i& acc, __m512i u, const int32_t* quad) {
  acc = _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(*quad));
}

// 16 exact int64 joins D = (e0 * 128 + e1) * 128 + e2 of one x row's three digit dots (each e less the offset's
// share, kOffset * the digit row's sum), as float32 times u and scale: out[0 .. 16)
inline void join(const __m512i acc[3], const int32_t* sums, float u, const float* scale, float* out) {
  __m512i half[2][3];
  for (int i = 0; i < 3; ++i) {
    const __m512i e = _mm512_sub_epi32(acc[i], _mm512_set1_epi32(static_cast<int32_t>(kOffset * sums[i])));
    half[0][i] = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(e));
    half[1][i] = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(e, 1));
  }
  __m256 f[2];
  for (int h = 0; h < 2; ++h) {
    const __m512i D = _mm512_add_epi64(
        _mm512_slli_epi64(_mm512_add_epi64(_mm512_slli_epi64(half[h][0], 7), half[h][1]), 7), half[h][2]);
    f[h] = _mm512_cvtepi64_ps(D);  // rounded to nearest, as static_cast<float>(int64)
  }
  const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(f[0]), f[1], 1);
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(u)), _mm512_loadu_ps(scale)));
}

struct Dots {
  const int32_t* panels;
  const int32_t* quads;  // the legend's; a tile's digit rows `stride` apart
  int64_t stride;
  const XDigits& d;
  const float* scale;
  int64_t K4;

  // sums[(s * MT + m) * 16 + r] = x row m0 + m . W row 16 (p + s * apart) + r, scaled, for S panels `apart` apart.
  // Each digit row's dots run as C chains (quad j feeds chain j % C): enough in all to hide vpdpbusd's latency.
  // Integer sums: any chains give the same bits. Every loop over the accumulators is unrolled by pragma.
  template <int MT, int S, int Locality>
  void run(int64_t p, int64_t apart, int64_t m0, float* sums) const {
    constexpr int DR = 3 * MT, C = S * DR >= 6 ? 1 : 2;
    static_assert(S * DR * C <= 12, "accumulators past the registers");
    __m512i acc[S * DR * C];
#pragma GCC unroll 32
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 32
      for (int r = 0; r < DR; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[(s * DR + r) * C + c] = _mm512_setzero_si512();
    const int32_t* panel[S];
    for (int s = 0; s < S; ++s) panel[s] = panels + (p + s * apart) * K4 * kPanel;
    const int32_t* q = quads + m0 / kTile * K4 * stride;  // digit row r's quad j: q[j * stride + r]
    for (int64_t j0 = 0; j0 < K4; j0 += C)  // K4 is a multiple of 16
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) {
          const int32_t* at = panel[s] + (j0 + c) * kPanel;
          __builtin_prefetch(reinterpret_cast<const char*>(at) + kAheadBytes / S, 0, Locality);
          const __m512i w = _mm512_loadu_si512(at);
#pragma GCC unroll 32
          for (int r = 0; r < DR; ++r) dpbusd(acc[(s * DR + r) * C + c], w, q + (j0 + c) * stride + r);
        }
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        __m512i joined[3];
#pragma GCC unroll 3
        for (int i = 0; i < 3; ++i) {
          joined[i] = acc[(s * DR + 3 * m + i) * C];
          if constexpr (C == 2) joined[i] = _mm512_add_epi32(joined[i], acc[(s * DR + 3 * m + i) * C + 1]);
        }
        const int64_t n0 = (p + s * apart) * kPanel;
        join(joined, d.sum.data() + 3 * (m0 + m), d.u[m0 + m], scale + n0, sums + (s * MT + m) * kPanel);
      }
  }
};

}  // namespace

torch::Tensor int8_panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                int64_t N, const c10::optional<torch::Tensor>& bias, int64_t streams,
                                bool non_temporal) {
  panel_rows::check_call(x, streams);
  const int64_t M = x.size(0), K = x.size(1), K4 = int8_panels::quads(K);
  TORCH_CHECK(K <= 65536, "K must be at most 65,536 (int32 dots), got ", K);
  int8_panels::check_copy(panels, &scale, N, K);
  const torch::Tensor bias32 = panel_rows::float_bias(bias, N);
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const torch::Tensor xc = x.contiguous();
  const XDigits d = digit_rows(xc.data_ptr<at::BFloat16>(), M, K, kStep);
  // a pass's digit rows interleaved: one stream of x's quads, not 3T (AMD EPYC Zen 4, 2 threads, weights from memory:
  // 2048 x 8192 at 4 / 32 rows 1.000 -> 0.749 / 5.95 -> 3.95 ms, 16384 x 2048 1.67 -> 1.55 / 8.32 -> 7.78)
  const int64_t T = std::min(M, kTile), stride = 3 * T, tiles = (M + T - 1) / T;
  std::vector<int32_t> quads(tiles * K4 * stride, 0);
  const int32_t* rows = reinterpret_cast<const int32_t*>(d.q.data());  // [R, K4]
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t r = 0; r < std::min(stride, 3 * M - t * stride); ++r)
      for (int64_t j = 0; j < K4; ++j) quads[(t * K4 + j) * stride + r] = rows[(t * stride + r) * K4 + j];
  panel_rows::run<1, kTile>(Dots{panels.data_ptr<int32_t>(), quads.data(), stride, d, scale.data_ptr<float>(), K4},
                            bias32, M, N, y.data_ptr<at::BFloat16>(), streams, non_temporal);
  return y;
}

// The copy's values back as W (w, not w + 128: integers, exact in bf16) into out [N, K]: `dequant.panels`' dense W,
// dequant.linear's from the rows bit for bit, for prefill's product where the rows were dropped (int8_panels.py).
torch::Tensor int8_panel_dequantize(const torch::Tensor& panels, int64_t N, torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.device().is_cpu() &&
                  out.size(0) == N && N > 0 && out.size(1) > 0,
              "out must be a contiguous CPU bfloat16 [N, K]");
  const int64_t K = out.size(1), K4 = int8_panels::quads(K), P = (N + kPanel - 1) / kPanel;
  int8_panels::check_copy(panels, nullptr, N, K);
  const int32_t* from = panels.data_ptr<int32_t>();
  at::BFloat16* to = out.data_ptr<at::BFloat16>();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t live = std::min(kPanel, N - p * kPanel);
      for (int64_t j = 0; j < K4 && 4 * j < K; ++j) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(from + (p * K4 + j) * kPanel), flip);
        const int64_t bytes = std::min<int64_t>(4, K - 4 * j) * sizeof(at::BFloat16);
        #pragma GCC unroll 4  // extracti32x4 takes an immediate
        for (int i = 0; i < 4; ++i) {  // rows 4i .. 4i + 3's quads: a float's high half is its bf16, exactly
          const __m512i q = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w, i));
          const __m512i f = _mm512_castps_si512(_mm512_cvtepi32_ps(q));
          alignas(32) int64_t quads[4];  // row 4i + t's four bf16
          _mm256_store_si256(reinterpret_cast<__m256i*>(quads), _mm512_cvtepi32_epi16(_mm512_srli_epi32(f, 16)));
          for (int t = 0; t < 4 && 4 * i + t < live; ++t)
            std::memcpy(to + (p * kPanel + 4 * i + t) * K + 4 * j, &quads[t], bytes);
        }
      }
    }
  });
  return out;
}

#endif  // AVX512-VNNI
