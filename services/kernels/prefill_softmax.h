// The prefill attention's online softmax (prefill_attention.cpp): one key block's step for a task's rows, between
// the block's two products.
//
// Legend: N = kKeys keys per block, R rows of a task, Dh head dim, E the probabilities' element (bf16 or float32).
//   s: [R, N] float32 raw scores q.k;  maxes: [R] raw-score maxima;  sums: [R, 16] partial sums (one per lane)
//   p: [R, N] E, the block's e^(scale (s - max));  o: [R, Dh] float32 output rows, rescaled when a maximum rises
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "softmax_math.h"

namespace prefill_softmax {

// N: keys per block, four 16-lane vectors of scores per query row (measured: 64 keys amortize the
// softmax's per-block reductions and rescaling ~10% better than 32)
inline constexpr int64_t kKeys = 64;

#if !defined(__AVX512F__)
// One key block's online-softmax step for row r (CPUs without AVX-512; softmax_rows16 there): s [N] raw scores
// q.k, of which the first `visible` count (the causal bound); p [N] gets e^(scale (s - new max)), zeros past
// `visible`; o [Dh] and the row's sums [16] (partial sums, one per vector lane) are rescaled to the new max. Maxes are
// kept in raw score units (scale > 0), so each score costs one FMA before its exponential.
template <typename E>
void softmax_step(const float* s, int64_t visible, float scale, float& max, float* sums, E* p, float* o, int64_t Dh) {
  visible = std::min(visible, kKeys);
  if (visible <= 0) {  // a block wholly after this row's position
    std::fill(p, p + kKeys, static_cast<E>(0.f));
    return;
  }
  constexpr int64_t V = kKeys / 16;
  float new_max = max, alpha = 1.f;
#if defined(__AVX2__) && defined(__FMA__)
  // the same on 8 lanes, into sums' first 8 (probabilities in float32: there is no bf16 product here)
  static_assert(std::is_same_v<E, float>, "AVX2 hosts pack float32");
  constexpr int64_t V8 = kKeys / 8;
  const float log2e_scale = 1.44269504f * scale;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sv[V8], keep[V8];
  __m256 vmax = neg_inf;
  for (int64_t v = 0; v < V8; ++v) {
    const int in = static_cast<int>(std::clamp<int64_t>(visible - 8 * v, 0, 8));
    keep[v] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(in), iota));
    sv[v] = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + 8 * v), keep[v]);  // -inf past `visible`
    vmax = _mm256_max_ps(vmax, sv[v]);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  new_max = std::max(max, _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
  if (new_max > max)  // 0 on the first block (max = -inf): 2^-126 times sums and o that are 0
    alpha = _mm256_cvtss_f32(exp2_nonpositive(_mm256_set1_ps(std::max((max - new_max) * log2e_scale, -150.f))));
  const __m256 c = _mm256_set1_ps(log2e_scale), shift = _mm256_set1_ps(-new_max * log2e_scale);
  __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(sums), _mm256_set1_ps(alpha));
  for (int64_t v = 0; v < V8; ++v) {
    const __m256 e = _mm256_and_ps(keep[v], exp2_nonpositive(_mm256_fmadd_ps(sv[v], c, shift)));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(p + 8 * v, e);
  }
  _mm256_storeu_ps(sums, sum);
#else
  for (int64_t n = 0; n < visible; ++n) new_max = std::max(new_max, s[n]);
  alpha = std::exp(scale * (max - new_max));  // 0 on the first block (max = -inf)
  sums[0] *= alpha;
  for (int64_t n = 0; n < kKeys; ++n) {
    const float e = n < visible ? std::exp(scale * (s[n] - new_max)) : 0.f;
    p[n] = static_cast<E>(e);
    sums[0] += e;
  }
#endif
  if (alpha != 1.f)
    for (int64_t d = 0; d < Dh; ++d) o[d] *= alpha;
  max = new_max;
}
#endif

#if defined(__AVX512F__)
// softmax_step for n <= 16 rows at once (row i: s + i N, visible[i], maxes[i], ...), the same arithmetic lane for
// lane: the rows' maxima by one transposing tree (fold_lanes16) and their rescaling factors by one exponential, not
// one chain a row. Why: with the products on AMX tiles the per-row steps were half a prefill layer (`1b` shapes,
// 1,024 tokens).
template <typename E>
void softmax_rows16(const float* s, const int64_t* visible, int64_t n, float scale, float* maxes, float* sums, E* p,
                    float* o, int64_t Dh) {
  constexpr int64_t V = kKeys / 16;
  constexpr int kDegree = std::is_same_v<E, float> ? 6 : 4;
  const float log2e_scale = 1.44269504f * scale;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto lanes_of = [&](int64_t i, int64_t v) {  // row i's live lanes of vector v (none past n)
    const int64_t in = i < n ? std::clamp<int64_t>(std::min(visible[i], kKeys) - 16 * v, 0, 16) : 0;
    return static_cast<__mmask16>((1u << in) - 1);
  };
  __m512 row_max[16];
  for (int64_t i = 0; i < 16; ++i) {
    row_max[i] = minus_inf;
    for (int64_t v = 0; v < V; ++v)
      row_max[i] = _mm512_max_ps(row_max[i], _mm512_mask_loadu_ps(minus_inf, lanes_of(i, v), s + i * kKeys + 16 * v));
  }
  const __mmask16 rows = static_cast<__mmask16>((1u << n) - 1);
  const __m512 old_max = _mm512_mask_loadu_ps(minus_inf, rows, maxes);
  const auto larger = [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); };
  const __m512 new_max = _mm512_max_ps(old_max, fold_lanes16(row_max, larger));
  const __mmask16 risen = _mm512_cmp_ps_mask(new_max, old_max, _CMP_GT_OQ);  // 0 on the first block (max = -inf)
  const __m512 drop = _mm512_mul_ps(_mm512_sub_ps(old_max, new_max), _mm512_set1_ps(log2e_scale));
  const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), risen,
                                          exp2_nonpositive<kDegree>(_mm512_max_ps(drop, _mm512_set1_ps(-150.f))));
  _mm512_mask_storeu_ps(maxes, rows, new_max);
  alignas(64) float alphas[16], news[16];
  _mm512_store_ps(alphas, alpha);
  _mm512_store_ps(news, new_max);
  const __m512 c = _mm512_set1_ps(log2e_scale);
  for (int64_t i = 0; i < n; ++i) {
    const __m512 shift = _mm512_set1_ps(-news[i] * log2e_scale);
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(sums + i * 16), _mm512_set1_ps(alphas[i]));
    for (int64_t v = 0; v < V; ++v) {
      const __mmask16 live = lanes_of(i, v);
      const __m512 sv = _mm512_mask_loadu_ps(minus_inf, live, s + i * kKeys + 16 * v);
      const __m512 e = _mm512_maskz_mov_ps(live, exp2_nonpositive<kDegree>(_mm512_fmadd_ps(sv, c, shift)));
      sum = _mm512_add_ps(sum, e);
      if constexpr (std::is_same_v<E, float>) {
        _mm512_storeu_ps(p + i * kKeys + 16 * v, e);
      } else {
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i * kKeys + 16 * v), (__m256i)_mm512_cvtneps_pbh(e));
#endif
      }
    }
    _mm512_storeu_ps(sums + i * 16, sum);
    if (alphas[i] != 1.f)
      for (int64_t d = 0; d < Dh; ++d) o[i * Dh + d] *= alphas[i];
  }
}
#endif

// A key block's softmax step for rows 0 .. R - 1, row r seeing visible(r) of its keys (the causal bound).
template <typename E, typename Visible>
void softmax_rows(const float* s, int64_t R, Visible visible, float scale, float* maxes, float* sums, E* p, float* o,
                  int64_t Dh) {
#if defined(__AVX512F__)
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, R - r0);
    int64_t seen[16];
    for (int64_t i = 0; i < n; ++i) seen[i] = visible(r0 + i);
    softmax_rows16(s + r0 * kKeys, seen, n, scale, maxes + r0, sums + r0 * 16, p + r0 * kKeys, o + r0 * Dh, Dh);
  }
#else
  for (int64_t r = 0; r < R; ++r)
    softmax_step(s + r * kKeys, visible(r), scale, maxes[r], sums + r * 16, p + r * kKeys, o + r * Dh, Dh);
#endif
}

}  // namespace prefill_softmax
