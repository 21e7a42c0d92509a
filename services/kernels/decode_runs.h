// Decode attention on AVX-512 CPUs over a float32 or float16 pool, a run of up to kRun tokens of one pool block at a
// time, and the pool walk by runs that the bf16 path (decode_pairs.h) shares. paged_decode_attention.cpp holds the
// softmax and the other paths; decode_blocks.h the AVX2 one.
//
// Legend: G query heads sharing one kv head, Q query heads of a task (its scores' row length), Dh head dim, n <= kRun
// tokens of a run, rows `stride` elements apart (the pool's token rows).
//   qf:      [G, Dh]   float32, pre-scaled (score_heads)
//   p:       [n, Q]    float32 softmax numerators (weigh_run, from p[0, h])
//   k, v:    [n, *]    the run's key / value rows, Dh elements read from each
//   scores:  [n, Q]    written from scores[0, g]; acc: [G, Dh] float32, Dh apart
//
// Why: the token-at-a-time loops (every value weighed into accumulators kept in memory) ran at ~1 instruction a cycle
// on an AMD EPYC Zen 5, waiting on store-to-load forwarding; weigh_run keeps a run's sums in registers.
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

// The run after the one being worked on: fetch(part, parts) asks for part `part` of its rows' cache lines, into the
// L2 cache. Why by parts: one run of a whole token row (K 8 x Dh 64 bf16) is 16 KB, 256 lines; asked for in one burst
// at the start of a run, most of them found the outstanding-miss queues full and came later as demand misses, and
// into L1 they pushed out the run being read (32 KB on a Zen 4). One bf16 layer of 32 sequences x 1,024 tokens, 2
// threads of an AMD EPYC Zen 4, from memory: 5.8-7.3 ms a burst into L2, 3.3-3.5 ms by parts (decode_pairs.h).
template <typename T>
struct NextRun {
  const T* first;  // its first row (kv head kh on), nullptr past the context
  int64_t n, stride, lines;  // rows, elements from one row to the next, cache lines a row

  // (always inlined: called out of line, once per head, the bf16 path ran at half its speed from memory)
  // Line l of the run is line l % lines of row l / lines: one division a call, then rows walked whole. A 64-bit
  // division per prefetch (a quarter of the bf16 path's samples) cost one sequence's 500 tokens 46.3 -> 38.5 us from
  // the caches, 32 sequences x 1,024 tokens 4.32 -> 3.95 ms (AMD EPYC Zen 4, 2 threads). Where the rows are whole
  // token rows (a task of every kv head: a batch's) the run is one range of lines: a row and line counter per
  // prefetch was ~6% of the AMX path's 32 x 1,024-token layer from L2 (Intel Xeon, family 6 model 207).
  __attribute__((always_inline)) void fetch(int64_t part, int64_t parts) const {
    const int64_t total = n * lines, begin = part * total / parts, end = (part + 1) * total / parts;
    if (begin >= end) return;
    const char* at = reinterpret_cast<const char*>(first);
    const int64_t row_bytes = stride * static_cast<int64_t>(sizeof(T));
    if (64 * lines == row_bytes) {  // whole rows back to back: one range of lines
      for (const char *line = at + 64 * begin, *stop = at + 64 * end; line < stop; line += 64)
        __builtin_prefetch(line, 0, 2);
      return;
    }
    const int64_t row = begin / lines;
    at += row * row_bytes;
    for (int64_t l = row * lines; l < end; l += lines, at += row_bytes) {
      const int64_t from = std::max<int64_t>(begin - l, 0), to = std::min(end - l, lines);
      for (int64_t line = from; line < to; ++line) __builtin_prefetch(at + 64 * line, 0, 2);
    }
  }
};

// Calls fn(t0, first, n, next) for the context's tokens a run of n <= kRun at a time within one pool block: tokens
// t0 .. t0 + n - 1, whose rows (kv head kh on) are first + c * K * Dh; next: the following run (NextRun), for fn to
// fetch while it works (the blocks are scattered through the pool). span: the elements fn reads of each row.
constexpr int64_t kRun = 16;
template <typename T, typename Fn>
inline void for_each_run(const T* base, const int64_t* table, int64_t T_len, int64_t K, int64_t kh, int64_t span,
                         int64_t Dh, int64_t block_size, Fn&& fn) {
  const int64_t stride = K * Dh, lines = (span * static_cast<int64_t>(sizeof(T)) + 63) / 64;
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
    fn(t0, first, n, NextRun<T>{next, next_n, stride, lines});
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

}  // namespace decode_runs

#endif  // AVX-512
