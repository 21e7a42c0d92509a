// Decode attention for CPUs with AVX2 but not AVX-512, a chunk of the context at a time with an online
// softmax (paged_decode_attention.cpp holds the pool walk, the AVX-512 and the scalar paths).
//
// Legend: G query heads sharing one kv head, Dh head dim (a multiple of 16, at most 256), C tokens of one
// chunk (at most kChunk, all in one pool block).
//   q:      [G, Dh]  float32, pre-scaled by the softmax scale
//   k, v:   [C, *]   rows `stride` elements apart (the pool's token rows), Dh elements read from each
//   state:  per query head its running max m, its sum of exponentials l, and acc [Dh]: the values weighed
//           by exp(score - m) so far (out = acc / l once every chunk is in)
//
// Why: the token-at-a-time loop before this one (one dot product per head per token, each summed across its
// lanes, then every value row weighed into accumulators kept in memory) ran at ~200 cycles per token and kv
// head on a Zen 2, against ~70 of arithmetic: it waited on its horizontal sums, and on store-to-load
// forwarding, its accumulators being stored and loaded again for each token. Here a chunk's keys are
// converted once into a float32 scratch, eight tokens' scores come out of one transposing reduction, and
// the values are weighed with the accumulators held in registers over the whole chunk.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define PDSERVE_DECODE_BLOCKS 1

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "softmax_math.h"
#include "vec_load.h"

namespace decode_blocks {

constexpr int64_t kChunk = 16;  // tokens per chunk: two groups of 8 scores

struct HeadState {
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  float* acc;  // [Dh]
};

// The 8 lanes' sums of a[0..7], as one vector (lane i: the sum of a[i]'s lanes).
inline __m256 sum_lanes8(const __m256 a[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);  // [0 1 2 3 | 0 1 2 3] halves
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[j] = q . kf[j] for j < 8; kf: [8, Dh] float32, Dh / 8 = DV steps.
template <int DV>
inline __m256 score8(const float* q, const float* kf) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int d = 0; d < DV; ++d) {
    const __m256 qv = _mm256_loadu_ps(q + 8 * d);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + j * DV * 8 + 8 * d), acc[j]);
  }
  return sum_lanes8(acc);
}

// acc[h][0..15] += sum over c < n of p[h * kChunk + c] * v[c][0..15], for HB heads, accumulators in registers.
template <typename T, int HB>
inline void weigh_values16(const float* p, const T* v, int64_t stride, int64_t n, float* const acc[]) {
  __m256 a0[HB], a1[HB];
  for (int h = 0; h < HB; ++h) a0[h] = _mm256_loadu_ps(acc[h]), a1[h] = _mm256_loadu_ps(acc[h] + 8);
  for (int64_t c = 0; c < n; ++c, v += stride) {
    const __m256 v0 = load8(v), v1 = load8(v + 8);
    for (int h = 0; h < HB; ++h) {
      const __m256 w = _mm256_broadcast_ss(p + h * kChunk + c);
      a0[h] = _mm256_fmadd_ps(w, v0, a0[h]);
      a1[h] = _mm256_fmadd_ps(w, v1, a1[h]);
    }
  }
  for (int h = 0; h < HB; ++h) _mm256_storeu_ps(acc[h], a0[h]), _mm256_storeu_ps(acc[h] + 8, a1[h]);
}

template <typename T, int DV>
void chunk_dv(const float* q, const T* k, const T* v, int64_t stride, int64_t n, int64_t G, HeadState* heads,
              float* kf, float* p) {
  constexpr int64_t Dh = 8 * DV;
  const int64_t groups = (n + 7) / 8;  // of 8 tokens; rows n .. 8 * groups - 1 of kf are zeros
  for (int64_t c = 0; c < n; ++c)
    for (int d = 0; d < DV; ++d) _mm256_storeu_ps(kf + c * Dh + 8 * d, load8(k + c * stride + 8 * d));
  for (int64_t c = n; c < groups * 8; ++c)
    for (int d = 0; d < DV; ++d) _mm256_storeu_ps(kf + c * Dh + 8 * d, _mm256_setzero_ps());
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    __m256 s[2] = {minus_inf, minus_inf};
    for (int64_t i = 0; i < groups; ++i) {
      s[i] = score8<DV>(q + g * Dh, kf + i * 8 * Dh);
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i left = _mm256_set1_epi32(static_cast<int>(n - 8 * i));  // tokens left: lanes past them get -inf
      s[i] = _mm256_blendv_ps(minus_inf, s[i], _mm256_castsi256_ps(_mm256_cmpgt_epi32(left, lane)));
    }
    HeadState& st = heads[g];
    const float m = std::max(st.m, max8(_mm256_max_ps(s[0], s[1])));
    if (m > st.m) {  // rescale what is summed so far to the new maximum
      const float r = st.m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(st.m - m);
      st.l *= r;
      for (int64_t d = 0; d < Dh; d += 8)
        _mm256_storeu_ps(st.acc + d, _mm256_mul_ps(_mm256_loadu_ps(st.acc + d), _mm256_set1_ps(r)));
      st.m = m;
    }
    const __m256 e0 = exp_nonpositive(_mm256_sub_ps(s[0], _mm256_set1_ps(m)));
    const __m256 e1 = groups > 1 ? exp_nonpositive(_mm256_sub_ps(s[1], _mm256_set1_ps(m))) : _mm256_setzero_ps();
    _mm256_storeu_ps(p + g * kChunk, e0);
    _mm256_storeu_ps(p + g * kChunk + 8, e1);
    st.l += sum8(_mm256_add_ps(e0, e1));
  }
  for (int64_t g = 0; g < G; g += 4) {  // four heads at a time share each value row's load
    float* acc[4];
    const int64_t hb = std::min<int64_t>(4, G - g);
    for (int64_t d = 0; d < Dh; d += 16) {
      for (int64_t h = 0; h < hb; ++h) acc[h] = heads[g + h].acc + d;
      const float* pg = p + g * kChunk;
      switch (hb) {
        case 1: weigh_values16<T, 1>(pg, v + d, stride, n, acc); break;
        case 2: weigh_values16<T, 2>(pg, v + d, stride, n, acc); break;
        case 3: weigh_values16<T, 3>(pg, v + d, stride, n, acc); break;
        default: weigh_values16<T, 4>(pg, v + d, stride, n, acc); break;
      }
    }
  }
}

// Whether chunk() takes this head dim: a multiple of 16 up to 256.
inline bool supports(int64_t Dh) { return Dh % 16 == 0 && Dh >= 16 && Dh <= 256; }

// One chunk of n <= kChunk tokens for the G heads of one kv head. kf: scratch [kChunk, Dh] float32; p: scratch
// [G, kChunk] float32.
template <typename T>
void chunk(const float* q, const T* k, const T* v, int64_t stride, int64_t n, int64_t G, int64_t Dh,
           HeadState* heads, float* kf, float* p) {
  switch (Dh / 16) {
#define PDSERVE_DV_CASE(i) \
  case i: chunk_dv<T, 2 * i>(q, k, v, stride, n, G, heads, kf, p); break;
    PDSERVE_DV_CASE(1) PDSERVE_DV_CASE(2) PDSERVE_DV_CASE(3) PDSERVE_DV_CASE(4) PDSERVE_DV_CASE(5)
    PDSERVE_DV_CASE(6) PDSERVE_DV_CASE(7) PDSERVE_DV_CASE(8) PDSERVE_DV_CASE(9) PDSERVE_DV_CASE(10)
    PDSERVE_DV_CASE(11) PDSERVE_DV_CASE(12) PDSERVE_DV_CASE(13) PDSERVE_DV_CASE(14) PDSERVE_DV_CASE(15)
    PDSERVE_DV_CASE(16)
#undef PDSERVE_DV_CASE
    default: TORCH_CHECK(false, "decode_blocks: head dim ", Dh, " is not a multiple of 16 up to 256");
  }
}

}  // namespace decode_blocks

#endif
