// Per-channel int8 weights (weight-only int8) in int8_panels.py's 16-row panel copy, times several rows of bf16 x on
// CPUs with AVX512-BF16 and VBMI: y = x @ (W * scale)^T (+ bias) by bf16 pairs in float32 sums — not
// int8_panel_linear's digit product, the same product up to float32 rounding.
//
// Legend (int8_panel_linear.cpp's): M rows of x, K input features, Kp = K rounded up to 64, K4 = Kp / 4 column quads,
// N output features, P = ceil(N / 16) panels.
//   x:      [M, K]       bfloat16 -> [M, Kp] with zeros past K: row m's quad j, 4 bf16, read as one 64-bit lane
//   panels: [P, K4, 16]  int32: lane r of entry (p, j) holds W[16p + r, 4j .. 4j + 3] + 128 as four unsigned bytes
//   scale:  [P * 16]     float32;  bias [N] or none
//   y:      [M, N]       bfloat16, float32 sums times scale (+ bias) rounded once
//
// Why: the digit passes (three vpdpbusd a row per entry) ran 1.04-1.34x native.4parts' time at 4 rows, so a weight's
// rows stayed for its 2-8-row bucket; here an entry costs 7 instructions for any number of rows and two vdpbf16ps a
// row. With each thread's panels read as one stream it ran 1.15-1.35x native.4parts at 2-4 rows, as two streams
// (`streams` 2: panels `per` apart, as the one-row kernels read) within 0-4% of native.4parts.nt, and the fastest of
// all at 8-16 rows (AMD EPYC Zen 4, 2 threads, docs/benchmarks.md session 43).

#include <torch/extension.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

#include "int8_panel_copy.h"
#include "panel_rows.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)

namespace {

using panel_rows::kPanel;
constexpr int64_t kAheadBytes = 1024;  // prefetch distance in all (each of S streams: 1 / S of it)
constexpr int64_t kStreamRows = 4;  // rows read as 2 streams: S MT 2 accumulators in registers

// Several rows of bf16 x as bf16 pairs (int8_panel_bf16_linear): an entry's 64 bytes become two registers of bf16
// without arithmetic, by skinny_rows.h's byte tables (|w| indexes bf16(|w|)'s low and high bytes, w's sign goes into
// the high byte), unpacked so that lane 4L + 2t + h of the first holds row 4L + t's column pair h of the quad (the
// second: rows 4L + 2 + t) — then x's quad broadcast as 64 bits, (x0, x1 | x2, x3), meets each lane's own pair, and
// each row's two lanes are added at the end: 7 instructions an entry for any number of rows, then 2 vdpbf16ps a row,
// where the digit rows take 3 vpdpbusd a row.
struct Bf16Tables {
  alignas(64) uint8_t lo[128], hi[128];
  Bf16Tables() {
    for (int v = 0; v < 128; ++v) {
      const uint32_t u = std::bit_cast<uint32_t>(static_cast<float>(v));
      lo[v] = static_cast<uint8_t>(u >> 16);
      hi[v] = static_cast<uint8_t>(u >> 24);
    }
  }
};

struct PairDots {
  const int32_t* panels;
  const at::BFloat16* x;  // [M, Kp], zeros past K
  const float* scale;
  int64_t K4;

  template <int MT, int S, int Locality>
  void run(int64_t p, int64_t apart, int64_t m0, float* sums) const {
    static const Bf16Tables tables;
    const __m512i lo_a = _mm512_load_si512(tables.lo), lo_b = _mm512_load_si512(tables.lo + 64);
    const __m512i hi_a = _mm512_load_si512(tables.hi), hi_b = _mm512_load_si512(tables.hi + 64);
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 acc[S][MT][2];
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) acc[s][m][0] = acc[s][m][1] = _mm512_setzero_ps();
    const int64_t* quads = reinterpret_cast<const int64_t*>(x + m0 * 4 * K4);  // row m's quad j: quads[m K4 + j]
    for (int64_t j = 0; j < K4; ++j)
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const int32_t* at = panels + ((p + s * apart) * K4 + j) * kPanel;
        __builtin_prefetch(reinterpret_cast<const char*>(at) + kAheadBytes / S, 0, Locality);
        const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(at), sign);  // w + 128 -> w
        const __m512i mag = _mm512_abs_epi8(q);
        const __m512i lo = _mm512_permutex2var_epi8(lo_a, mag, lo_b);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi_a, mag, hi_b), q, sign, 0xF8);
        const __m512bh first = (__m512bh)_mm512_unpacklo_epi8(lo, hi), second = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const __m512bh xq = (__m512bh)_mm512_set1_epi64(quads[m * K4 + j]);
          acc[s][m][0] = _mm512_dpbf16_ps(acc[s][m][0], first, xq);
          acc[s][m][1] = _mm512_dpbf16_ps(acc[s][m][1], second, xq);
        }
      }
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const __m512 sc = _mm512_loadu_ps(scale + (p + s * apart) * kPanel);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {  // lanes 4L, 4L + 2: rows 4L, 4L + 1 (first), 4L + 2, 4L + 3 (second)
        const __m512 a = _mm512_add_ps(acc[s][m][0], _mm512_permute_ps(acc[s][m][0], 0xB1));
        const __m512 b = _mm512_add_ps(acc[s][m][1], _mm512_permute_ps(acc[s][m][1], 0xB1));
        _mm512_storeu_ps(sums + (s * MT + m) * kPanel, _mm512_mul_ps(_mm512_shuffle_ps(a, b, 0x88), sc));
      }
    }
  }
};

}  // namespace

// See the file's legend; `streams` 1 or 2: each thread's panels read as one stream or two (up to kStreamRows rows).
torch::Tensor int8_panel_bf16_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                     int64_t N, const c10::optional<torch::Tensor>& bias, int64_t streams,
                                     bool non_temporal) {
  panel_rows::check_call(x, streams);
  TORCH_CHECK(streams <= 2, "streams must be 1 or 2, got ", streams);
  const int64_t M = x.size(0), K = x.size(1), K4 = int8_panels::quads(K);
  int8_panels::check_copy(panels, &scale, N, K);
  const torch::Tensor bias32 = panel_rows::float_bias(bias, N);
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const std::vector<at::BFloat16> xp = panel_rows::padded_x(x, 4 * K4);  // Kp columns
  panel_rows::run<1, panel_rows::kTile, kStreamRows>(PairDots{panels.data_ptr<int32_t>(), xp.data(),
                                                               scale.data_ptr<float>(), K4},
                                                      bias32, M, N, y.data_ptr<at::BFloat16>(), streams, non_temporal);
  return y;
}

#endif  // AVX512-BF16 and VBMI
