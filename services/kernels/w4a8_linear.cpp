// w4a8 on CPUs with AVX512-VNNI: group-wise int4 weights times activations rounded to int8 per 32-column group
// (llama.cpp's Q4 arithmetic), y = x_q @ W^T (+ bias), the products exact in int32 (vpdpbusd) and scaled per group in
// float32. Shapes, layout and the float32 chain of every output: w4a8_panels.h.
//
// Legend (beyond w4a8_panels.h's): NR = 32 W rows (two panels) per register tile, KC = 128 columns per chunk,
// MR <= 4 rows of x per register tile.
//
// Two paths run the same chain (few rows: W's nibbles widened in registers; many: a chunk of two panels widened once
// into L1 and multiplied in register tiles), so a product's result never depends on its row count. Why: a
// compute-bound product (prefill, big batches) on a CPU with AVX512-VNNI multiplies 64 int8 pairs per instruction
// against vdpbf16ps's 32 bf16 pairs (AMD EPYC Zen 4, 2 threads: 445 against 225 per ns); W stored in panels needs no
// transposes, and one row streams W at ~0.08 instructions a weight.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "count_dispatch.h"
#include "thread_chunks.h"
#include "w4a8_panels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

using w4a8::GroupScale, w4a8::kGroup, w4a8::kPanel, w4a8::RoundedRows, w4a8::store_row;
using Weights = w4a8::Panels;

// Group k0 of row x [K] (zeros past K) rounded as the legend says: its int8 values into q [32], its s and z returned.
template <typename T>
inline GroupScale round_group(const T* x, int64_t K, int64_t k0, int8_t* q) {
  alignas(64) float v[kGroup];
  const int64_t len = std::min(kGroup, K - k0);
  for (int64_t k = 0; k < len; ++k) v[k] = static_cast<float>(x[k0 + k]);
  std::fill(v + len, v + kGroup, 0.f);
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float s = amax / 127.f;
  // vcvtps2dq rounds halves to even (the default rounding mode), as torch.round does
  const __m512 d = _mm512_set1_ps(amax > 0.f ? s : 1.f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(v0, d)), q1 = _mm512_cvtps_epi32(_mm512_div_ps(v1, d));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  return {s, s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)))};
}

constexpr int64_t kNR = 2 * kPanel, kKC = 128, kMR = 4, kChunkGroups = kKC / kGroup;
constexpr int64_t kPass = 8;  // rows of x per pass over a panel in the few-row path (one dot chain and one sum each)
// Up to this many rows of x: the few-row path. Each panel read once from memory against passes of 8 rows beat the
// tile's chunk widening at every row count up to 96 (the `1b` shapes 1.04-1.4x), on a par at 128 (AMD EPYC Zen 4,
// 2 threads, bf16 x, weights cycled from memory; passes of 4 rows with W streamed once per pass were 1.1-1.2x slower).
constexpr int64_t kDirectRows = 96;

inline __m512 halves(const at::Half* h) {  // 16 float16 as float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

// One octet of a panel (64 bytes) as two vectors of 16 lanes, each lane four q of its row: columns 8o .. 8o + 3 (lo)
// and 8o + 4 .. 8o + 7 (hi).
inline void widen(const uint8_t* octet, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_loadu_si512(octet), mask = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(v, mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
}

// acc = fma(low, z, fma(float(dot), scale * s, acc)): one group's step of every output's chain
inline __m512 group_step(__m512i dot, __m512 scale, __m512 low, float s, float z, __m512 acc) {
  const __m512 scaled = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(s)), acc);
  return _mm512_fmadd_ps(low, _mm512_set1_ps(z), scaled);
}

// Few rows (M <= kDirectRows): each panel once from memory, against kPass rows of x at a time, widened in registers.
template <int MR, typename T>
void panel_rows(const Weights& w, const RoundedRows& x, int64_t m0, int64_t p, const float* bias, T* y) {
  const int64_t groups = w.Kp / kGroup;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[MR];
    for (int m = 0; m < MR; ++m) dot[m] = _mm512_setzero_si512();
    for (int64_t o = 4 * g; o < 4 * g + 4; ++o) {
      __builtin_prefetch(w.octet(p, o) + 1024, 0, 3);  // 16 octets (two groups) ahead in this panel's stream
      __m512i lo, hi;
      widen(w.octet(p, o), lo, hi);
      for (int m = 0; m < MR; ++m) {
        const int8_t* xq = x.q.data() + (m0 + m) * w.Kp + 8 * o;
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq)));
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + 4)));
      }
    }
    const __m512 scale = halves(w.group_scale(p, g)), low = halves(w.group_low(p, g));
    for (int m = 0; m < MR; ++m)
      acc[m] = group_step(dot[m], scale, low, x.s[(m0 + m) * groups + g], x.z[(m0 + m) * groups + g], acc[m]);
  }
  const int64_t live = std::min(kPanel, w.N - p * kPanel);
  for (int m = 0; m < MR; ++m) {
    alignas(64) float sums[kPanel];
    _mm512_store_ps(sums, acc[m]);
    store_row(sums, bias ? bias + p * kPanel : nullptr, live, y + (m0 + m) * w.N + p * kPanel);
  }
}

template <typename T>
void few_rows(const Weights& w, const RoundedRows& x, int64_t M, const float* bias, T* y) {
  parallel_chunks(w.panels, [&](int64_t p0, int64_t p1) {  // chunks of panels the threads take in turn
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += kPass)
        with_count(std::min(kPass, M - m0), [&](auto mr) { panel_rows<decltype(mr)::value>(w, x, m0, p, bias, y); });
  });
}

// Many rows: per thread, two panels' chunk (NR rows x KC columns) widened into `chunk` [KC / 4, NR] int32 (lane n of
// entry j: q[n, 4j .. 4j + 3]) with its parameters ws, wl [KC / G, NR], then every tile of x against it.
inline void widen_chunk(const Weights& w, int64_t p, int64_t k0, int32_t* chunk, float* ws, float* wl) {
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t panel = p + half;
    for (int64_t o = 0; o < kKC / 8; ++o) {
      __m512i lo = _mm512_setzero_si512(), hi = lo;
      if (panel < w.panels && k0 + 8 * o < w.Kp) widen(w.octet(panel, k0 / 8 + o), lo, hi);
      _mm512_storeu_si512(chunk + (2 * o) * kNR + kPanel * half, lo);
      _mm512_storeu_si512(chunk + (2 * o + 1) * kNR + kPanel * half, hi);
    }
    for (int64_t g = 0; g < kChunkGroups; ++g) {
      const bool live = panel < w.panels && k0 + g * kGroup < w.Kp;
      const int64_t at = k0 / kGroup + g;
      _mm512_storeu_ps(ws + g * kNR + kPanel * half, live ? halves(w.group_scale(panel, at)) : _mm512_setzero_ps());
      _mm512_storeu_ps(wl + g * kNR + kPanel * half, live ? halves(w.group_low(panel, at)) : _mm512_setzero_ps());
    }
  }
}

// sums [MR, NR] (+)= x's tile . chunk, group by group (group_step)
template <int MR>
inline void tile(const int32_t* xq, const float* xs, const float* xz, const int32_t* chunk, const float* ws,
                 const float* wl, bool first, float* sums) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + m * kNR + 16 * h);
  for (int64_t g = 0; g < kChunkGroups; ++g) {
    __m512i dot[MR][2];
    for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int64_t j = g * kGroup / 4; j < (g + 1) * kGroup / 4; ++j) {
      const __m512i w0 = _mm512_loadu_si512(chunk + j * kNR), w1 = _mm512_loadu_si512(chunk + j * kNR + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512i xb = _mm512_set1_epi32(xq[j * kMR + m]);
        dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], w0, xb);
        dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], w1, xb);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_loadu_ps(ws + g * kNR + 16 * h), low = _mm512_loadu_ps(wl + g * kNR + 16 * h);
      for (int m = 0; m < MR; ++m)
        acc[m][h] = group_step(dot[m][h], scale, low, xs[g * kMR + m], xz[g * kMR + m], acc[m][h]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(sums + m * kNR + 16 * h, acc[m][h]);
}

struct TiledX {  // many rows: x rounded, in tile order
  std::vector<int32_t> q;  // [Kx / KC, tiles, KC / 4, MR]: four int8 of x in each, zeros past K and past M
  std::vector<float> s, z;  // [Kx / KC, tiles, KC / G, MR]
  int64_t tiles;
};

template <typename T>
TiledX tile_x(const T* x, int64_t M, int64_t K, int64_t Kx) {
  TiledX p;
  p.tiles = (M + kMR - 1) / kMR;
  p.q.assign(Kx / kKC * p.tiles * kKC / 4 * kMR, 0);
  p.s.assign(Kx / kKC * p.tiles * kChunkGroups * kMR, 0.f);
  p.z.assign(p.s.size(), 0.f);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    alignas(64) int8_t q[kGroup];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
        const int64_t g = k0 % kKC / kGroup, tile_at = k0 / kKC * p.tiles + m / kMR;
        const GroupScale scale = round_group(x + m * K, K, k0, q);
        const int32_t* words = reinterpret_cast<const int32_t*>(q);
        for (int64_t j = 0; j < kGroup / 4; ++j)
          p.q[(tile_at * kKC / 4 + g * kGroup / 4 + j) * kMR + m % kMR] = words[j];
        p.s[(tile_at * kChunkGroups + g) * kMR + m % kMR] = scale.s;
        p.z[(tile_at * kChunkGroups + g) * kMR + m % kMR] = scale.z;
      }
  });
  return p;
}

template <typename T>
void many_rows(const Weights& w, const TiledX& x, int64_t M, int64_t Kx, const float* bias, T* y) {
  const int64_t pairs = (w.panels + 1) / 2, q_chunk = x.tiles * kKC / 4 * kMR, s_chunk = x.tiles * kChunkGroups * kMR;
  at::parallel_for(0, pairs, 1, [&](int64_t a0, int64_t a1) {
    std::vector<int32_t> chunk(kKC / 4 * kNR);
    std::vector<float> ws(kChunkGroups * kNR), wl(kChunkGroups * kNR), sums(M * kNR);
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t n0 = a * kNR, live = std::min(kNR, w.N - n0);
      for (int64_t k0 = 0; k0 < Kx; k0 += kKC) {
        widen_chunk(w, 2 * a, k0, chunk.data(), ws.data(), wl.data());
        const int64_t c = k0 / kKC;
        for (int64_t t = 0; t < x.tiles; ++t) {
          const int32_t* xq = x.q.data() + c * q_chunk + t * kKC / 4 * kMR;
          const float *xs = x.s.data() + c * s_chunk + t * kChunkGroups * kMR, *xz = x.z.data() + (xs - x.s.data());
          float* out = sums.data() + t * kMR * kNR;
          switch (std::min(kMR, M - t * kMR)) {
            case 1: tile<1>(xq, xs, xz, chunk.data(), ws.data(), wl.data(), k0 == 0, out); break;
            case 2: tile<2>(xq, xs, xz, chunk.data(), ws.data(), wl.data(), k0 == 0, out); break;
            case 3: tile<3>(xq, xs, xz, chunk.data(), ws.data(), wl.data(), k0 == 0, out); break;
            default: tile<4>(xq, xs, xz, chunk.data(), ws.data(), wl.data(), k0 == 0, out);
          }
        }
      }
      for (int64_t m = 0; m < M; ++m)
        store_row(sums.data() + m * kNR, bias ? bias + n0 : nullptr, live, y + m * w.N + n0);
    }
  });
}

template <typename T>
void product(const Weights& w, const T* x, int64_t M, int64_t K, const float* bias, T* y) {
  if (M <= kDirectRows) {
    few_rows(w, w4a8::round_rows(x, M, K, w.Kp, round_group<T>), M, bias, y);
  } else {
    const int64_t Kx = (w.Kp + kKC - 1) / kKC * kKC;
    many_rows(w, tile_x(x, M, K, Kx), M, Kx, bias, y);
  }
}

}  // namespace

// See w4a8_panels.h: y = x_q @ W^T (+ bias) in x's dtype, W [N, K] in panels.
torch::Tensor w4a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias) {
  return w4a8::call(x, packed, scale, low, N, bias, [](const Weights& w, const auto* xv, int64_t M, int64_t K,
                                                       const float* b, auto* y) { product(w, xv, M, K, b, y); });
}

#endif  // AVX512-VNNI
