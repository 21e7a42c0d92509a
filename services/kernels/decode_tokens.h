// Decode attention a token at a time, the paged_decode_attention.cpp path that the others fall back to: float32 and
// float16 pools, bf16 ones on CPUs without AVX512-BF16, head dims no multiple of 32. With AVX-512 and Dh a multiple of
// 16, each key row is loaded once as float32 vectors for the G heads sharing it (decode_runs.h's score_heads) and the
// values are weighed a run at a time (decode_runs.h's weigh); elsewhere the same loops run scalar (the compiler
// vectorizes what it can). AVX2 CPUs take decode_blocks.h instead where it applies.
//
// Legend: G query heads sharing one kv head, nkh kv heads of a task (kh0 the first), Q = nkh * G, Dh head dim, K kv
// heads of the pool, T_len a sequence's context length.
//   qf:      [Q, Dh]        float32, pre-scaled
//   keys:    [S, K, Dh]     the pool's keys (values alike), rows found through `table` (block ids)
//   scores:  [T_len, Q]     float32, token-major (softmax_numerators)
//   acc:     [Q, Dh]        float32, the output: softmax(qf . k) v
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "decode_runs.h"
#include "softmax_math.h"
#include "vec_load.h"

namespace decode_tokens {

// scores [T, Q] (token-major: a token's Q scores are adjacent) -> exp(score - maxes[h]), summed per
// head into sums [Q]. Token-major because head-major rows of T floats sit a power of two apart and
// thrash the L1 cache's sets (measured: 2-3x slower at T = 1024).
inline void softmax_numerators(float* scores, int64_t T_len, int64_t Q, const float* maxes, float* sums) {
  std::fill(sums, sums + Q, 0.f);
#if defined(__AVX512F__)
  for (int64_t h = 0; h < Q; h += 16) {
    const __mmask16 lanes = Q - h >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (Q - h)) - 1);
    const __m512 max = _mm512_maskz_loadu_ps(lanes, maxes + h);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < T_len; ++t) {
      float* row = scores + t * Q + h;
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row), max));
      _mm512_mask_storeu_ps(row, lanes, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_mask_storeu_ps(sums + h, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, sums + h), sum));
  }
#else
  int64_t done = 0;  // scores done: all of them where 8 lanes fit the head layout
#if defined(__AVX2__) && defined(__FMA__)
  // 8 scores at a time over the flat [T * Q] scores, where the heads tile the lanes: Q divides 8
  // (lane i is head i % Q in every vector) or 8 divides Q (lanes h0 .. h0 + 7 of each token's row)
  if (8 % Q == 0 || Q % 8 == 0) {
    const int64_t n = T_len * Q / 8 * 8, period = std::max<int64_t>(Q, 8);
    std::vector<float> lane_max(period), lane_sum(period, 0.f);
    for (int64_t i = 0; i < period; ++i) lane_max[i] = maxes[i % Q];
    for (int64_t j = 0; j < n; j += 8) {
      const int64_t lane = j % period;
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_loadu_ps(&lane_max[lane])));
      _mm256_storeu_ps(scores + j, e);
      _mm256_storeu_ps(&lane_sum[lane], _mm256_add_ps(_mm256_loadu_ps(&lane_sum[lane]), e));
    }
    for (int64_t i = 0; i < period; ++i) sums[i % Q] += lane_sum[i];
    done = n;
  }
#endif
  for (int64_t j = done; j < T_len * Q; ++j) {
    float& p = scores[j];
    p = std::exp(p - maxes[j % Q]);
    sums[j % Q] += p;
  }
#endif
}

// Calls fn(t, row) for each of the first T_len tokens, `row` pointing at kv head kh of that token
// in the pool: block by block, so no per-token division. With few heads per task a token's slice
// is K * Dh elements away from the next token's, a stride the hardware prefetchers miss (measured:
// latency-bound, ~100 ns per token), so the rows a few tokens ahead are prefetched by hand.
template <typename T, typename Fn>
inline void for_each_token(const T* base, const int64_t* table, int64_t T_len, int64_t K, int64_t kh, int64_t span,
                           int64_t Dh, int64_t block_size, Fn&& fn) {
  // span: elements read from kh on (nkh * Dh); a whole row (span == K * Dh) streams by itself
  constexpr int64_t kAhead = 8;
  const bool prefetch = span < K * Dh;
  const int64_t row_bytes = span * static_cast<int64_t>(sizeof(T)), stride = K * Dh;
  const int64_t num_blocks = (T_len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * block_size, n = std::min(block_size, T_len - start);
    const T* row = base + (table[b] * block_size * K + kh) * Dh;
    const T* next = b + 1 < num_blocks ? base + (table[b + 1] * block_size * K + kh) * Dh : nullptr;
    for (int64_t i = 0; i < n; ++i, row += stride) {
      if (prefetch) {
        const int64_t into_next = i + kAhead - n;  // the token ahead, counted into the next block
        const T* ahead = into_next < 0 ? row + kAhead * stride
                         : (next != nullptr && into_next < block_size ? next + into_next * stride : nullptr);
        if (ahead != nullptr && start + i + kAhead < T_len)
          for (int64_t off = 0; off < row_bytes; off += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(ahead) + off);
      }
      fn(start + i, row);
    }
  }
}

// One task: a sequence's kv heads kh0 .. kh0 + nkh - 1 and their query heads (Q = nkh * G, in order).
// qf: [Q, Dh] float32, pre-scaled; scores: [T, Q]; acc: [Q, Dh]. Taking several adjacent heads per task reads
// each token's row of the pool as one contiguous run.
template <typename T>
void attend_task(const float* qf, const T* keys, const T* values, const int64_t* table, int64_t T_len, int64_t K,
                 int64_t kh0, int64_t nkh, int64_t G, int64_t Dh, int64_t block_size, float* scores, float* acc) {
  const int64_t Q = nkh * G;
  std::vector<float> maxes(Q, -std::numeric_limits<float>::infinity());
  int64_t weighed = 0;  // tokens whose values are weighed in
  [[maybe_unused]] const bool vectorized = Dh % 16 == 0 && Dh <= 256;  // (AVX-512; AVX2 takes decode_blocks.h)
  for_each_token(keys, table, T_len, K, kh0, nkh * Dh, Dh, block_size, [&](int64_t t, const T* row) {
    for (int64_t j = 0; j < nkh; ++j) {
      const T* k = row + j * Dh;
#if defined(__AVX512F__)
      if (vectorized) {
        decode_runs::score_heads(qf + j * G * Dh, k, G, Dh, scores + t * Q + j * G, maxes.data() + j * G);
        continue;
      }
#endif
      for (int64_t h = j * G; h < (j + 1) * G; ++h) {
        float s = 0.f;
        for (int64_t d = 0; d < Dh; ++d) s += qf[h * Dh + d] * scalar_to_float(k[d]);
        scores[t * Q + h] = s;
        maxes[h] = std::max(maxes[h], s);
      }
    }
  });
  std::vector<float> sums(Q);
  softmax_numerators(scores, T_len, Q, maxes.data(), sums.data());
  std::fill(acc, acc + Q * Dh, 0.f);
#if defined(__AVX512F__)
  if (vectorized) {
    decode_runs::for_each_run(values, table, T_len, K, kh0, nkh * Dh, Dh, block_size,
                              [&](int64_t t0, const T* first, int64_t n, const decode_runs::NextRun<T>& next) {
                                next.fetch(0, 1);
                                decode_runs::weigh(first, K * Dh, n, nkh, G, Dh, scores + t0 * Q, Q, acc);
                              });
    weighed = T_len;
  }
#endif
  for_each_token(values, table, T_len - weighed, K, kh0, nkh * Dh, Dh, block_size, [&](int64_t t, const T* row) {
    for (int64_t j = 0; j < nkh; ++j) {
      const T* v = row + j * Dh;
      for (int64_t h = j * G; h < (j + 1) * G; ++h) {
        const float p = scores[t * Q + h];
        for (int64_t d = 0; d < Dh; ++d) acc[h * Dh + d] += p * scalar_to_float(v[d]);
      }
    }
  });
  for (int64_t h = 0; h < Q; ++h)
    for (int64_t d = 0; d < Dh; ++d) acc[h * Dh + d] /= sums[h];
}

}  // namespace decode_tokens
