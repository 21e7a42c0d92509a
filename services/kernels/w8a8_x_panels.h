// w8a8's product for many rows of x on AVX512-VNNI CPUs (w8a8_linear.cpp's legend and definition, bit for bit):
// x's rounded rows packed once per call into panels of 16 rows, W's rows read four bytes at a time (in place, or from a
// copy: group_rows), each broadcast to every lane against a panel vector, so an accumulator's 16 lanes are 16 rows of x
// against one W row and no sum crosses lanes.
//
// Legend (besides w8a8_linear.cpp's): G = Kp / 4 groups of 4 columns, P = ceil(M / 16) panels, kNR = 12 W rows and
// XP <= 2 panels a register tile (24 accumulators), a group: the kNR W rows a tile reads.
//   panel: [P, G, 16] int32  lane r of vector g: row 16 p + r's columns 4 g .. 4 g + 3 of xq, each byte + 128 (as
//          unsigned; rows past M: xq = 0)
//   wsum:  [kNR] int32       sum_k w[n, k] of the group's rows: sum_k (xq + 128) w = dot + 128 wsum
//   copy:  [kNR, S] int8     a thread's copy of a group's rows (S: Kp, or Kp + 64 where Kp / 64 is even)
//   dots:  [kNR, 32] int32   a tile's sums, row j: W row j against the tile's x rows
//
// Why: the 4 x 4 tiles (w8a8_linear.cpp) load a W and an x vector per 2 vpdpbusd and sum each accumulator's 16 lanes
// at the end of every tile (16 of them in ~30 instructions); at 32 rows they ran 261 multiply-accumulates per ns of the
// 467 vpdpbusd can do (AMD EPYC Zen 4, 2 threads, 16384 x 2048). Here a step loads 2 panel vectors and broadcasts 12
// W dwords for 24 vpdpbusd; what it adds is a pass over each W row for its sum (from the caches: the previous group's
// tiles fetched it; where the rows are copied, the same pass) and x's repacking (M x Kp bytes a call). Zen 4, 2
// threads, bf16 x, 16 / 32 / 64 / 256 rows against the 4 x 4 tiles (with vpdpbusd's own broadcast, before the
// register one below): 16384 x 2048 1.0 / 1.10 / 1.14 / 1.11x, 3072 x 2048 1.29 / 1.24 / 1.28 / 1.25x, 2048 x 8192
// (copied) 0.85 / 0.97 / 0.96 / 0.99x.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_rounding.h"
#include "thread_chunks.h"

namespace {

constexpr int64_t kPanelNR = 12;

struct XPanels {
  std::vector<int32_t> data;  // [P, G, 16]
  int64_t G, P;
};

inline XPanels pack_panels(const RoundedX& x, int64_t M) {
  XPanels p{{}, x.Kp / 4, (M + 15) / 16};
  constexpr int32_t kFlip = static_cast<int32_t>(0x80808080u);
  p.data.assign(p.P * p.G * 16, kFlip);
  at::parallel_for(0, p.P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t pi = p0; pi < p1; ++pi)
      for (int64_t r = 0; r < 16 && 16 * pi + r < M; ++r) {
        const int8_t* row = x.q.data() + (16 * pi + r) * x.Kp;
        int32_t* out = p.data.data() + pi * p.G * 16 + r;
        for (int64_t g = 0; g < p.G; ++g) {
          int32_t v;
          std::memcpy(&v, row + 4 * g, 4);
          out[16 * g] = v ^ kFlip;
        }
      }
  });
  return p;
}

// The rows a group's tiles read (W rows [n0, n1), n1 - n0 <= kPanelNR) and their sums, into wsum: W itself (*stride =
// K) where K is a whole number of 64-byte lines but not of 4 KB and the group is whole; else a copy into `copy`
// [kPanelNR, S] (*stride = S, zeros past K and past n1). Why a copy at multiples of 4 KB: rows that far apart fall in
// one set of the L1 cache (64 sets of 64 bytes), 12 rows for its 8 ways; at K 8,192 the tiles ran at 0.8x the 4 x 4
// tiles' speed in place, 1.0x from the copy, whose S / 64 is odd (a set each). Elsewhere the copy cost 4-6% (K 2,048).
inline const int8_t* group_rows(const int8_t* w, int64_t n0, int64_t n1, int64_t K, int64_t S, int8_t* copy,
                                int32_t* wsum, int64_t* stride) {
  const bool in_place = K % 64 == 0 && K % 4096 != 0 && n1 - n0 == kPanelNR;
  const __m512i ones = _mm512_set1_epi8(1);
  *stride = in_place ? K : S;
  for (int64_t j = 0; j < kPanelNR; ++j) {
    const int8_t* row = w + (n0 + j) * K;
    __m512i acc = _mm512_setzero_si512();
    for (int64_t k = 0; k < *stride; k += 64) {
      const __mmask64 live = n0 + j >= n1 || k >= K ? 0 : K - k >= 64 ? ~__mmask64{0} : (__mmask64{1} << (K - k)) - 1;
      const __m512i v = _mm512_maskz_loadu_epi8(live, row + k);
      acc = _mm512_dpbusd_epi32(acc, ones, v);
      if (!in_place) _mm512_storeu_si512(copy + j * S + k, v);
    }
    wsum[j] = _mm512_reduce_add_epi32(acc);
  }
  return in_place ? w + n0 * K : copy;
}

// dots[j][16 t + r] = panel t's row r . W row j + 128 wsum[j], for XP panels from `panel` and kNR W rows w + j S;
// `fetch`: 48 bytes a step from there fetched into L2 on the way (the thread's next group; fetch_step 0: none), and
// each W row's line 4 lines ahead into L1 once a line. The W rows are addressed from four pointers (rows 0, 3, 6, 9)
// and K: with twelve GCC ran out of registers and kept the accumulators in memory. Each row's 4 bytes are broadcast
// once into a register for both panels (vpbroadcastd): vpdpbusd's own {1to16} memory operand, one a product, ran
// 7-10% slower (AMD EPYC Zen 4, 2 threads, 16-256 rows of the `1b` shapes; gate_up at 32 rows 3.89 against 3.64 ms).
template <int XP>
inline void panel_tile(const int32_t* panel, int64_t G, const int8_t* w, int64_t S, const int8_t* fetch,
                       int64_t fetch_step, int32_t dots[kPanelNR][32]) {
  __m512i acc[XP][kPanelNR];
#pragma GCC unroll 2
  for (int t = 0; t < XP; ++t) {
#pragma GCC unroll 12
    for (int j = 0; j < kPanelNR; ++j) acc[t][j] = _mm512_setzero_si512();
  }
  const int8_t *a = w, *b = w + 3 * S, *c = w + 6 * S, *d = w + 9 * S;
  const int32_t* xp = panel;
  for (int64_t g = 0; g < G; ++g, a += 4, b += 4, c += 4, d += 4, xp += 16, fetch += fetch_step) {
    _mm_prefetch(reinterpret_cast<const char*>(fetch), _MM_HINT_T1);
    const int8_t* const row[kPanelNR] = {a, a + S, a + 2 * S, b, b + S, b + 2 * S,
                                         c, c + S, c + 2 * S, d, d + S, d + 2 * S};
    if (g % 16 == 0) {
#pragma GCC unroll 12
      for (int j = 0; j < kPanelNR; ++j) _mm_prefetch(reinterpret_cast<const char*>(row[j] + 256), _MM_HINT_T0);
    }
    __m512i xv[XP];
#pragma GCC unroll 2
    for (int t = 0; t < XP; ++t) xv[t] = _mm512_loadu_si512(xp + t * G * 16);
#pragma GCC unroll 12
    for (int j = 0; j < kPanelNR; ++j) {
      int32_t v;
      std::memcpy(&v, row[j], 4);
      const __m512i wj = _mm512_set1_epi32(v);  // W row j's 4 bytes in every lane, for both panels
#pragma GCC unroll 2
      for (int t = 0; t < XP; ++t) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], xv[t], wj);
    }
  }
#pragma GCC unroll 2
  for (int t = 0; t < XP; ++t) {
#pragma GCC unroll 12
    for (int j = 0; j < kPanelNR; ++j) _mm512_storeu_si512(dots[j] + 16 * t, acc[t][j]);
  }
}

// 16 floats rounded to bf16 as c10::BFloat16 rounds one (halves to even, NaN -> 0x7FC0)
inline __m256i bf16_lanes(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_mask_mov_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16),
                                          _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// out [16] = the tile's y for one W row n and 16 rows of x (float(dot) xs scale, in the dtype, + bias rounded again)
template <typename T>
inline void finish_lanes(__m512i dot, __m512 xs, float scale, const T* bias, T out[16]) {
  const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), xs), _mm512_set1_ps(scale));
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, bias ? _mm512_add_ps(v, _mm512_set1_ps(*bias)) : v);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    __m256i r = bf16_lanes(v);
    if (bias) {
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
      r = bf16_lanes(_mm512_add_ps(back, _mm512_set1_ps(static_cast<float>(*bias))));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), r);
  } else {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i r = _mm512_cvtps_ph(v, kNearest);
    if (bias) r = _mm512_cvtps_ph(_mm512_add_ps(_mm512_cvtph_ps(r), _mm512_set1_ps(static_cast<float>(*bias))), kNearest);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), r);
  }
}

// y for W rows [n0, n1) (one group, n1 - n0 <= kPanelNR) and every row of x; fetch: whether the group after it (n1
// on) is this thread's next; copy [kPanelNR, S]: the thread's buffer for group_rows.
template <typename T>
void panel_group(const XPanels& px, const RoundedX& x, int64_t M, const int8_t* w, int64_t n0, int64_t n1,
                 bool fetch, int64_t N, int64_t K, int64_t S, int8_t* copy, const float* scale, const T* bias, T* y) {
  int32_t wsum[kPanelNR];
  int64_t stride;
  const int8_t* rows = group_rows(w, n0, n1, K, S, copy, wsum, &stride);
  alignas(64) int32_t dots[kPanelNR][32];
  alignas(64) T lanes[16];
  for (int64_t p = 0; p < px.P; p += 2) {
    const int32_t* panel = px.data.data() + p * px.G * 16;
    const int64_t fetch_step = fetch && p == 0 ? 48 : 0;
    const int xp = px.P - p >= 2 ? 2 : 1;
    if (xp == 2) panel_tile<2>(panel, px.G, rows, stride, w + n1 * K, fetch_step, dots);
    else panel_tile<1>(panel, px.G, rows, stride, w + n1 * K, fetch_step, dots);
    for (int t = 0; t < xp; ++t) {
      const int64_t m0 = 16 * (p + t), live_m = std::min<int64_t>(16, M - m0);
      const __m512 xs = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << live_m) - 1), x.s.data() + m0);
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t j = n - n0;
        const __m512i dot = _mm512_sub_epi32(_mm512_loadu_si512(dots[j] + 16 * t), _mm512_set1_epi32(128 * wsum[j]));
        finish_lanes(dot, xs, scale[n], bias ? bias + n : nullptr, lanes);
        for (int64_t r = 0; r < live_m; ++r) y[(m0 + r) * N + n] = lanes[r];
      }
    }
  }
}

// y = the legend's product for every row of x, W in groups of kPanelNR rows that the threads take in chunks.
template <typename T>
void panel_product(const RoundedX& x, int64_t M, const int8_t* w, int64_t N, int64_t K, const float* scale,
                   const T* bias, T* y) {
  const XPanels px = pack_panels(x, M);
  const int64_t groups = (N + kPanelNR - 1) / kPanelNR, S = x.Kp / 64 % 2 ? x.Kp : x.Kp + 64;
  parallel_chunks(groups, [&](int64_t g0, int64_t g1) {
    std::vector<int8_t> copy(kPanelNR * S);
    for (int64_t g = g0; g < g1; ++g)
      panel_group(px, x, M, w, g * kPanelNR, std::min(N, (g + 1) * kPanelNR), g + 1 < g1 && (g + 2) * kPanelNR <= N,
                  N, K, S, copy.data(), scale, bias, y);
  });
}

}  // namespace

#endif  // AVX512-VNNI
