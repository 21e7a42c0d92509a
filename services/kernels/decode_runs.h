// Decode attention on AVX-512 CPUs, a run of up to kRun tokens of one pool block at a time (paged_decode_attention.cpp
// holds the pool walk, the softmax and the other paths; decode_blocks.h the AVX2 one).
//
// Legend: G query heads sharing one kv head, Q query heads of a task (its scores' row length), Dh head dim, n <= kRun
// tokens of a run, rows `stride` elements apart (the pool's token rows).
//   q:       [G, Dh]   bf16, unscaled (score_run) ; p: [n, Q] float32 softmax numerators (weigh_run, from p[0, h])
//   k, v:    [n, *]    the run's key / value rows, Dh elements read from each
//   scores:  [n, Q]    written from scores[0, g]; acc: [G, Dh] float32, Dh apart
//
// Why: the token-at-a-time loops (score_heads: one horizontal sum per head and token; every value weighed into
// accumulators kept in memory) ran at ~1 instruction a cycle on an AMD EPYC Zen 5, waiting on their shuffle chains
// and on store-to-load forwarding. One bf16 layer of 32 sequences x 1,024 tokens (H 32, K 8, Dh 64), 2 threads, from
// memory: 3.4 -> 2.7-3.0 ms with contiguous blocks, 5.9 -> 3.9-4.2 ms with its blocks scattered; one thread from the
// caches 160 -> 80 ns a token. score_heads remains for float32 and float16 pools.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec_load.h"

namespace decode_runs {

// The four horizontal sums of v0..v3 at once (in lanes 0..3): one shuffle tree instead of four.
inline __m128 reduce4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));  // v0 v1 v0 v1 per lane
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));  // v0 v1 v2 v3
  const __m512 d = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0x4E));  // fold the 128-bit lanes
  const __m512 e = _mm512_add_ps(d, _mm512_shuffle_f32x4(d, d, 0xB1));
  return _mm512_castps512_ps128(e);
}

// out[h] = qf[h] . k for the G query heads (rows of qf [G, Dh]) sharing one key row k [Dh].
template <typename T>
inline void score_heads(const float* qf, const T* k, int64_t G, int64_t Dh, float* out, float* maxes) {
  __m512 kv[16];  // the key row as float32, loaded once for the G heads
  for (int64_t d = 0; d < Dh / 16; ++d) kv[d] = load16(k + 16 * d);
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {  // four heads' dot products, summed by one shuffle tree
    __m512 v[4];
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm512_mul_ps(_mm512_loadu_ps(qf + (g + j) * Dh), kv[0]);
      for (int64_t d = 1; d < Dh / 16; ++d)
        v[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + (g + j) * Dh + 16 * d), kv[d], v[j]);
    }
    alignas(16) float sums4[4];
    _mm_store_ps(sums4, reduce4(v[0], v[1], v[2], v[3]));
    for (int j = 0; j < 4; ++j) {
      out[g + j] = sums4[j];
      maxes[g + j] = std::max(maxes[g + j], sums4[j]);
    }
  }
  for (; g < G; ++g) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(qf + g * Dh), kv[0]);
    for (int64_t d = 1; d < Dh / 16; ++d) v = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * Dh + 16 * d), kv[d], v);
    out[g] = _mm512_reduce_add_ps(v);
    maxes[g] = std::max(maxes[g], out[g]);
  }
}

// Calls fn(t0, first, n) for the context's tokens a run of n <= kRun at a time within one pool block: tokens
// t0 .. t0 + n - 1, whose rows (kv head kh on) are first + c * K * Dh. The next run's rows (span elements each) are
// prefetched while fn works: the blocks are scattered through the pool.
constexpr int64_t kRun = 16;
template <typename T, typename Fn>
inline void for_each_run(const T* base, const int64_t* table, int64_t T_len, int64_t K, int64_t kh, int64_t span,
                         int64_t Dh, int64_t block_size, Fn&& fn) {
  const int64_t stride = K * Dh, row_bytes = span * static_cast<int64_t>(sizeof(T));
  const int64_t per_block = (block_size + kRun - 1) / kRun;
  auto run_at = [&](int64_t i, const T** first) {  // run i: block i / per_block, from (i % per_block) * kRun on
    const int64_t b = i / per_block, c = i % per_block * kRun, start = b * block_size + c;
    if (start >= T_len) return int64_t{0};
    *first = base + ((table[b] * block_size + c) * K + kh) * Dh;
    return std::min({kRun, block_size - c, T_len - start});
  };
  const T *first = nullptr, *next = nullptr;
  int64_t n = run_at(0, &first);
  for (int64_t i = 0, t0 = 0; n > 0; ++i) {
    const int64_t next_n = run_at(i + 1, &next);
    for (int64_t c = 0; c < next_n; ++c)
      for (int64_t at = 0; at < row_bytes; at += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(next + c * stride) + at);
    fn(t0, first, n);
    t0 += n;
    n = next_n;
    first = next;
  }
}

// acc[h][16 v ..] += sum_c p[c * Q + h] * v_c[16 v ..] for HB heads and DV vectors of 16 dims, over the n value
// rows v_c = v + c * stride: the accumulators stay in registers for the whole run (kept in memory per token they
// waited on store-to-load forwarding: ~1 instruction a cycle). acc rows are Dh apart. Each sum is the same FMAs
// in the same token order as one token at a time.
template <typename T, int HB, int DV>
__attribute__((always_inline)) inline void weigh_run(const T* v, int64_t stride, int64_t n, const float* p, int64_t Q,
                                                     float* acc, int64_t Dh) {
  __m512 a[HB][DV];
  for (int h = 0; h < HB; ++h)
    for (int d = 0; d < DV; ++d) a[h][d] = _mm512_loadu_ps(acc + h * Dh + 16 * d);
  for (int64_t c = 0; c < n; ++c, v += stride) {
    __m512 vv[DV];
    for (int d = 0; d < DV; ++d) vv[d] = load16(v + 16 * d);
    for (int h = 0; h < HB; ++h) {
      const __m512 w = _mm512_set1_ps(p[c * Q + h]);
      for (int d = 0; d < DV; ++d) a[h][d] = _mm512_fmadd_ps(w, vv[d], a[h][d]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + h * Dh + 16 * d, a[h][d]);
}

// weigh_run for hb <= 4 heads and dv <= 4 vectors, chosen at run time.
template <typename T, int HB>
__attribute__((always_inline)) inline void weigh_run_dv(int dv, const T* v, int64_t stride, int64_t n,
                                                        const float* p, int64_t Q, float* acc, int64_t Dh) {
  switch (dv) {
    case 1: weigh_run<T, HB, 1>(v, stride, n, p, Q, acc, Dh); break;
    case 2: weigh_run<T, HB, 2>(v, stride, n, p, Q, acc, Dh); break;
    case 3: weigh_run<T, HB, 3>(v, stride, n, p, Q, acc, Dh); break;
    default: weigh_run<T, HB, 4>(v, stride, n, p, Q, acc, Dh); break;
  }
}

#if defined(__AVX512BF16__)
// Sixteen vectors' lane sums as one vector (lane c: the sum of v[c]'s lanes): a transposing tree of 45 instructions,
// against a horizontal sum (~8, each a chain of shuffles and adds) per vector.
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i]'s partial sums at 0 and 2, v[2i + 1]'s at 1 and 3
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: v[4i .. 4i + 3]'s partial sums
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  // the 128-bit lanes summed, b[i]'s into lane i
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// A run's scores from a bf16 pool: scores[c * Q + g] = scale * (q[g] . k_c) for the G query heads (rows of q, Dh
// apart, unscaled bf16) sharing the n <= kRun key rows k_c = k + c * stride; DP = Dh / 32 bf16 pairs registers.
// vdpbf16ps multiplies the bf16 values exactly and sums in float32, 32 products an instruction, and sixteen tokens'
// sums come out of one transposing reduction (a key row converted to float32 and one horizontal sum per head
// and token ran at ~1 instruction a cycle).
template <int DP>
inline void score_run(const at::BFloat16* q, const at::BFloat16* k, int64_t stride, int64_t n, int64_t G, float scale,
                      float* scores, int64_t Q, float* maxes) {
  constexpr int64_t Dh = 32 * DP;
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t g = 0; g < G; ++g) {
    __m512bh qv[DP];
    for (int p = 0; p < DP; ++p) qv[p] = (__m512bh)_mm512_loadu_si512(q + g * Dh + 32 * p);
    __m512 v[kRun];
#pragma GCC unroll 16
    for (int c = 0; c < kRun; ++c) {
      v[c] = _mm512_setzero_ps();
      if (c < n)
        for (int p = 0; p < DP; ++p)
          v[c] = _mm512_dpbf16_ps(v[c], qv[p], (__m512bh)_mm512_loadu_si512(k + c * stride + 32 * p));
    }
    const __m512 s = _mm512_mul_ps(sum_lanes16(v), _mm512_set1_ps(scale));
    alignas(64) float lanes[kRun];
    _mm512_store_ps(lanes, s);
    for (int64_t c = 0; c < n; ++c) scores[c * Q + g] = lanes[c];
    maxes[g] = std::max(maxes[g], _mm512_mask_reduce_max_ps(live, s));
  }
}
#endif

// A run's value rows weighed into acc [Q, Dh] for the task's nkh kv heads: p [n, Q] from the run's first token.
// (Inlined, as weigh_run: called through a function per kv head it left the memory-bound case ~15% slower.)
template <typename T>
__attribute__((always_inline)) inline void weigh(const T* first, int64_t stride, int64_t n, int64_t nkh, int64_t G,
                                                 int64_t Dh, const float* p, int64_t Q, float* acc) {
  for (int64_t j = 0; j < nkh; ++j)
    for (int64_t g = 0; g < G; g += 4)  // four heads at a time share each value row's load
      for (int64_t d = 0; d < Dh; d += 64) {
        const T* v = first + j * Dh + d;
        float* a = acc + (j * G + g) * Dh + d;
        const int dv = static_cast<int>(std::min<int64_t>(64, Dh - d) / 16);
        switch (std::min<int64_t>(4, G - g)) {
          case 1: weigh_run_dv<T, 1>(dv, v, stride, n, p + j * G + g, Q, a, Dh); break;
          case 2: weigh_run_dv<T, 2>(dv, v, stride, n, p + j * G + g, Q, a, Dh); break;
          case 3: weigh_run_dv<T, 3>(dv, v, stride, n, p + j * G + g, Q, a, Dh); break;
          default: weigh_run_dv<T, 4>(dv, v, stride, n, p + j * G + g, Q, a, Dh); break;
        }
      }
}

#if defined(__AVX512BF16__)
// Whether score() takes this head dim: whole registers of bf16 pairs, at most 8.
inline bool scores_in_pairs(int64_t Dh) { return Dh % 32 == 0 && Dh >= 32 && Dh <= 256; }

// A run's scores [n, Q] (from its first token) for the task's nkh kv heads, q [Q, Dh] bf16 unscaled.
inline void score(const at::BFloat16* q, const at::BFloat16* first, int64_t stride, int64_t n, int64_t nkh, int64_t G,
                  int64_t Dh, float scale, float* scores, int64_t Q, float* maxes) {
  for (int64_t j = 0; j < nkh; ++j) {
    const at::BFloat16 *qj = q + j * G * Dh, *k = first + j * Dh;
    switch (Dh / 32) {
#define PDSERVE_DP_CASE(i) \
  case i: score_run<i>(qj, k, stride, n, G, scale, scores + j * G, Q, maxes + j * G); break;
      PDSERVE_DP_CASE(1) PDSERVE_DP_CASE(2) PDSERVE_DP_CASE(3) PDSERVE_DP_CASE(4)
      PDSERVE_DP_CASE(5) PDSERVE_DP_CASE(6) PDSERVE_DP_CASE(7) default: PDSERVE_DP_CASE(8)
#undef PDSERVE_DP_CASE
    }
  }
}
#endif

}  // namespace decode_runs

#endif  // AVX-512
