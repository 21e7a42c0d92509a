// Decode attention over a bf16 pool on CPUs with AVX512-BF16: every product by vdpbf16ps, the scores of a run of up to
// kRun tokens as one vector per query head, the probabilities rounded to bf16 pairs as the prefill kernel's are.
//
// Legend: G query heads sharing one kv head, nkh kv heads of a task, Q = nkh * G its query heads, Dh head dim (a
// multiple of 32, at most 256: DP = Dh / 32 registers of bf16 pairs), n <= kRun tokens of a run, R a task's runs.
//   q:      [Q, Dh]           bf16, unscaled, the task's query heads
//   keys, values: the pool's [S, K, Dh] halves, found a run at a time through the block table (decode_runs.h)
//   scores: [R, Q, kRun]      float32 per task: run r's scores of head h are one vector (lanes past n: -inf); then,
//                             in place, its softmax numerators as kRun bf16 (the vector's first half), token pairs
//                             (2i, 2i + 1) as 32-bit lanes i
//   acc:    [Q, Dh]           float32, the output; while the values are weighed, in pair order (weigh_pairs)
//
// Why: one bf16 layer of 32 sequences x 1,024 tokens (H 32, K 8, Dh 64) took 6.7-7.0 ms on 2 threads of an AMD EPYC
// Zen 4 (~10 GB/s), and ~200 ns a token on one thread from the caches, where its scores were stored one float at a
// time into a token-major buffer and its values weighed by float32 FMAs (4 per token and head at Dh 64, each value row
// converted to float32 first). Here a run's scores leave as one store per head, and the values are weighed two tokens
// at a time: one vdpbf16ps takes a pair of probabilities (broadcast) against two value rows interleaved
// (unpacklo/hi_epi16), 32 multiply-adds an instruction: ~110 ns a token from the caches; with the next run fetched by
// parts (decode_runs.h NextRun), 3.9-4.1 ms from memory. A probability rounded to bf16 moves the output by < 0.4% of
// the values' size, as the prefill kernel's (which multiplies bf16 pairs of them too) and torch's bf16 attention do.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "count_dispatch.h"
#include "decode_runs.h"
#include "softmax_math.h"

namespace decode_pairs {

using decode_runs::kRun;

inline bool supports(int64_t Dh) { return Dh % 32 == 0 && Dh >= 32 && Dh <= 256; }

// The n <= kRun scores of one query head q [Dh] against the key rows k + c * stride, lane c (lanes past n: 0): each
// token's DP products summed in its own register, then sixteen registers' lanes summed by one transposing tree.
template <int DP>
inline __m512 run_scores(const at::BFloat16* q, const at::BFloat16* k, int64_t stride, int64_t n) {
  __m512bh qv[DP];
  for (int p = 0; p < DP; ++p) qv[p] = (__m512bh)_mm512_loadu_si512(q + 32 * p);
  __m512 v[kRun];
#pragma GCC unroll 16
  for (int c = 0; c < kRun; ++c) {
    v[c] = _mm512_setzero_ps();
    if (c < n)
      for (int p = 0; p < DP; ++p)
        v[c] = _mm512_dpbf16_ps(v[c], qv[p], (__m512bh)_mm512_loadu_si512(k + c * stride + 32 * p));
  }
  return fold_lanes16(v, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

// acc[h] += sum_c p_h[c] * v_c for HB heads and SV source registers (32 dims each) of the n value rows
// v_c = v + c * stride, two rows at a time: unpacklo/hi_epi16 of rows 2i and 2i + 1 give 32-bit lanes
// (v_2i[d], v_2i+1[d]), multiplied by the pair (p[2i], p[2i + 1]) (pairs: p + h * kRun as int32, lane i). The sums
// stay in pair order: register 2s + half, lane 4L + j holds dim 32s + 8L + 4 half + j.
template <int HB, int SV>
__attribute__((always_inline)) inline void weigh_pairs(const at::BFloat16* v, int64_t stride, int64_t n,
                                                       const int32_t* pairs, float* acc, int64_t Dh) {
  __m512 a[HB][2 * SV];
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < 2 * SV; ++s) a[h][s] = _mm512_loadu_ps(acc + h * Dh + 16 * s);
  for (int64_t i = 0; 2 * i < n; ++i) {
    const at::BFloat16* row = v + 2 * i * stride;
    __m512i lo[SV], hi[SV];
    for (int s = 0; s < SV; ++s) {
      const __m512i even = _mm512_loadu_si512(row + 32 * s);
      const __m512i odd = 2 * i + 1 < n ? _mm512_loadu_si512(row + stride + 32 * s) : _mm512_setzero_si512();
      lo[s] = _mm512_unpacklo_epi16(even, odd);
      hi[s] = _mm512_unpackhi_epi16(even, odd);
    }
    for (int h = 0; h < HB; ++h) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pairs[h * kRun + i]);
      for (int s = 0; s < SV; ++s) {
        a[h][2 * s] = _mm512_dpbf16_ps(a[h][2 * s], w, (__m512bh)lo[s]);
        a[h][2 * s + 1] = _mm512_dpbf16_ps(a[h][2 * s + 1], w, (__m512bh)hi[s]);
      }
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < 2 * SV; ++s) _mm512_storeu_ps(acc + h * Dh + 16 * s, a[h][s]);
}

// The scores [R, Q, kRun] of `runs` runs turned in place into the softmax's numerators e^(s - max), kRun bf16 in the
// first half of each vector (lanes that were -inf: exactly 0), summed per head in float32 into sums [Q]. maxes
// [Q, kRun]: each head's lane-wise maxima.
inline void numerators(float* scores, int64_t runs, int64_t Q, const float* maxes, float* sums) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < Q; ++h) {
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(maxes + h * kRun)));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < runs; ++i) {
      float* at = scores + (i * Q + h) * kRun;
      const __m512 s = _mm512_loadu_ps(at);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, minus_inf, _CMP_NEQ_OQ),
                                           exp_nonpositive(_mm512_sub_ps(s, max)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), (__m256i)_mm512_cvtneps_pbh(e));
    }
    sums[h] = _mm512_reduce_add_ps(sum);
  }
}

// acc [Q, Dh] from pair order (weigh_pairs) to column order, each head's row divided by its sum: per 32 dims, the
// four-float chunks L of registers 2s and 2s + 1 become chunks 2L and 2L + 1. (One float at a time, its scalar
// divisions were ~2% of a 32 x 1,024-token layer from the caches.)
inline void normalize(float* acc, const float* sums, int64_t Q, int64_t Dh) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < Q; ++h) {
    const __m512 sum = _mm512_set1_ps(sums[h]);
    for (float* at = acc + h * Dh; at < acc + (h + 1) * Dh; at += 32) {
      const __m512 even = _mm512_loadu_ps(at), odd = _mm512_loadu_ps(at + 16);
      _mm512_storeu_ps(at, _mm512_div_ps(_mm512_permutex2var_ps(even, first, odd), sum));
      _mm512_storeu_ps(at + 16, _mm512_div_ps(_mm512_permutex2var_ps(even, second, odd), sum));
    }
  }
}

template <int HB>
__attribute__((always_inline)) inline void weigh_heads(int sv, const at::BFloat16* v, int64_t stride, int64_t n,
                                                       const int32_t* pairs, float* acc, int64_t Dh) {
  if (sv == 2) weigh_pairs<HB, 2>(v, stride, n, pairs, acc, Dh);
  else weigh_pairs<HB, 1>(v, stride, n, pairs, acc, Dh);
}

// One task (decode_runs' attend_task contract): acc [Q, Dh] = softmax(scale q . k) v for its query heads, normalized,
// in column order. scores: the task's buffer, resized here.
template <int DP>
void attend_task(const at::BFloat16* q, float scale, const at::BFloat16* keys, const at::BFloat16* values,
                 const int64_t* table, int64_t T_len, int64_t K, int64_t kh0, int64_t nkh, int64_t G,
                 int64_t block_size, std::vector<float>& scores, float* acc) {
  constexpr int64_t Dh = 32 * DP;
  const int64_t Q = nkh * G, stride = K * Dh;
  const int64_t runs = (T_len + block_size - 1) / block_size * ((block_size + kRun - 1) / kRun);
  scores.resize(runs * Q * kRun);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  std::vector<float> maxes(Q * kRun, -std::numeric_limits<float>::infinity());  // per head, lane-wise
  int64_t r = 0;
  decode_runs::for_each_run(keys, table, T_len, K, kh0, nkh * Dh, Dh, block_size,
                            [&](int64_t, const at::BFloat16* first, int64_t n,
                                const decode_runs::NextRun<at::BFloat16>& next) {
                              const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
                              float* run = scores.data() + r++ * Q * kRun;
                              for (int64_t h = 0; h < Q; ++h) {
                                next.fetch(h, Q);
                                const __m512 s = _mm512_mask_mov_ps(
                                    minus_inf, live,
                                    _mm512_mul_ps(run_scores<DP>(q + h * Dh, first + h / G * Dh, stride, n),
                                                  _mm512_set1_ps(scale)));
                                _mm512_storeu_ps(run + h * kRun, s);
                                _mm512_storeu_ps(maxes.data() + h * kRun,
                                                 _mm512_max_ps(_mm512_loadu_ps(maxes.data() + h * kRun), s));
                              }
                            });
  std::vector<float> sums(Q);
  numerators(scores.data(), r, Q, maxes.data(), sums.data());
  std::fill(acc, acc + Q * Dh, 0.f);
  r = 0;
  decode_runs::for_each_run(values, table, T_len, K, kh0, nkh * Dh, Dh, block_size,
                            [&](int64_t, const at::BFloat16* first, int64_t n,
                                const decode_runs::NextRun<at::BFloat16>& next) {
                              const int32_t* pairs = reinterpret_cast<const int32_t*>(scores.data() + r++ * Q * kRun);
                              const int64_t parts = nkh * ((G + 3) / 4);
                              for (int64_t j = 0; j < nkh; ++j)
                                for (int64_t g = 0; g < G; g += 4) {  // four heads at a time share each row pair
                                  next.fetch(j * ((G + 3) / 4) + g / 4, parts);
                                  for (int64_t d = 0; d < Dh; d += 64) {
                                    const at::BFloat16* v = first + j * Dh + d;
                                    const int32_t* p = pairs + (j * G + g) * kRun;
                                    float* a = acc + (j * G + g) * Dh + d;
                                    const int sv = static_cast<int>(std::min<int64_t>(64, Dh - d) / 32);
                                    switch (std::min<int64_t>(4, G - g)) {
                                      case 1: weigh_heads<1>(sv, v, stride, n, p, a, Dh); break;
                                      case 2: weigh_heads<2>(sv, v, stride, n, p, a, Dh); break;
                                      case 3: weigh_heads<3>(sv, v, stride, n, p, a, Dh); break;
                                      default: weigh_heads<4>(sv, v, stride, n, p, a, Dh); break;
                                    }
                                  }
                                }
                            });
  normalize(acc, sums.data(), Q, Dh);
}

// fn(std::integral_constant<int, DP>{}) for the head dim Dh = 32 * DP (supports(Dh)): a task's loops for a head dim
// chosen at run time (here and in decode_tiles.h).
template <typename Fn>
inline void with_steps(int64_t Dh, Fn&& fn) {
  with_count(Dh / 32, fn);
}

// attend_task for a head dim chosen at run time (supports(Dh)).
inline void attend_task_dh(int64_t Dh, const at::BFloat16* q, float scale, const at::BFloat16* keys,
                           const at::BFloat16* values, const int64_t* table, int64_t T_len, int64_t K, int64_t kh0,
                           int64_t nkh, int64_t G, int64_t block_size, std::vector<float>& scores, float* acc) {
  with_steps(Dh, [&](auto dp) {
    attend_task<decltype(dp)::value>(q, scale, keys, values, table, T_len, K, kh0, nkh, G, block_size, scores, acc);
  });
}

}  // namespace decode_pairs

#endif  // AVX512-BF16
