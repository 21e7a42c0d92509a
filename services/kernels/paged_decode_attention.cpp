// Decode attention read straight from the paged KV pool: one query token per sequence, each
// sequence's keys and values found through its block table, never copied out of the pool.
//
// Legend: B sequences, H query heads, K kv heads (G = H / K query heads share one), Dh head dim,
// S pool slots (num_blocks * block_size), T a sequence's context length.
//   q:            [B, H, Dh]   float32 / bfloat16 / float16
//   kv_cache:     [2, S, K, Dh] same dtype (keys, then values; one layer)
//   block_tables: [B, max_blocks] int64; context_lens: [B] int64
//   out:          [B, H, Dh]   q's dtype
//
// Each (sequence, kv head) pair is one task: scores of its G query heads against every key
// (float32), a softmax, then the values weighted by it. Every key and value is read once for the G
// heads that share it, which is all decode attention must read. With AVX-512 and Dh a multiple of
// 16, each key and value row is loaded once as float32 vectors and the softmax's exp is a
// polynomial on 16 scores at a time; elsewhere the same loops run scalar (the compiler vectorizes
// what it can).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_load.h"

namespace {

#if defined(__AVX512F__)
// e^x for x <= 0 (scores minus their maximum): 2^(x log2 e) split into an integer power, applied
// exactly by vscalefps, and 2^f for |f| <= 1/2 by its degree-6 Taylor polynomial (error ~1e-7).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif

// scores[t] = exp(scores[t] - max); returns their sum.
inline float softmax_numerators(float* scores, int64_t n, float max) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 vsum = _mm512_setzero_ps();
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + t), _mm512_set1_ps(max)));
    _mm512_storeu_ps(scores + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  return sum;
}

// Calls fn(t, row) for each of the first T_len tokens, `row` pointing at its [Dh] slice of one
// kv head in the pool: block by block, so no per-token division.
template <typename T, typename Fn>
inline void for_each_token(const T* base, const int64_t* table, int64_t T_len, int64_t K, int64_t kh, int64_t Dh,
                           int64_t block_size, Fn&& fn) {
  for (int64_t start = 0, b = 0; start < T_len; start += block_size, ++b) {
    const T* row = base + (table[b] * block_size * K + kh) * Dh;
    const int64_t n = std::min(block_size, T_len - start);
    for (int64_t i = 0; i < n; ++i, row += K * Dh) fn(start + i, row);
  }
}

// One (sequence, kv head) task. qf: [G, Dh] float32, pre-scaled; scores: [G, T]; acc: [G, Dh].
template <typename T>
void attend_one(const float* qf, const T* keys, const T* values, const int64_t* table, int64_t T_len, int64_t K,
                int64_t kh, int64_t G, int64_t Dh, int64_t block_size, float* scores, float* acc) {
  std::vector<float> maxes(G, -std::numeric_limits<float>::infinity());
  const bool vectorized = Dh % 16 == 0 && Dh <= 256;
  for_each_token(keys, table, T_len, K, kh, Dh, block_size, [&](int64_t t, const T* k) {
#if defined(__AVX512F__)
    if (vectorized) {
      __m512 kv[16];  // the key row as float32, loaded once for the G heads
      for (int64_t d = 0; d < Dh / 16; ++d) kv[d] = load16(k + 16 * d);
      for (int64_t g = 0; g < G; ++g) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(qf + g * Dh), kv[0]);
        for (int64_t d = 1; d < Dh / 16; ++d) v = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * Dh + 16 * d), kv[d], v);
        const float s = _mm512_reduce_add_ps(v);
        scores[g * T_len + t] = s;
        maxes[g] = std::max(maxes[g], s);
      }
      return;
    }
#endif
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < Dh; ++d) s += qf[g * Dh + d] * scalar_to_float(k[d]);
      scores[g * T_len + t] = s;
      maxes[g] = std::max(maxes[g], s);
    }
  });
  std::vector<float> sums(G);
  for (int64_t g = 0; g < G; ++g) sums[g] = softmax_numerators(scores + g * T_len, T_len, maxes[g]);
  std::fill(acc, acc + G * Dh, 0.f);
  for_each_token(values, table, T_len, K, kh, Dh, block_size, [&](int64_t t, const T* v) {
#if defined(__AVX512F__)
    if (vectorized) {
      for (int64_t d = 0; d < Dh; d += 16) {
        const __m512 vv = load16(v + d);  // one load of the value row serves all G heads
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc + g * Dh + d;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * T_len + t]), vv, _mm512_loadu_ps(a)));
        }
      }
      return;
    }
#endif
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * T_len + t];
      for (int64_t d = 0; d < Dh; ++d) acc[g * Dh + d] += p * scalar_to_float(v[d]);
    }
  });
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < Dh; ++d) acc[g * Dh + d] /= sums[g];
}

template <typename T>
void attend(const T* q, const T* cache, const int64_t* block_tables, const int64_t* context_lens, T* out, int64_t B,
            int64_t H, int64_t K, int64_t Dh, int64_t S, int64_t max_blocks, int64_t block_size, float scale) {
  const int64_t G = H / K;
  const T* keys = cache;  // [S, K, Dh]
  const T* values = cache + S * K * Dh;  // [S, K, Dh]
  at::parallel_for(0, B * K, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * Dh), acc(G * Dh), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / K, kh = task % K, T_len = context_lens[b];
      for (int64_t g = 0; g < G; ++g)  // this kv head's query heads, scaled once
        for (int64_t d = 0; d < Dh; ++d) qf[g * Dh + d] = scalar_to_float(q[(b * H + kh * G + g) * Dh + d]) * scale;
      scores.resize(G * T_len);
      attend_one(qf.data(), keys, values, block_tables + b * max_blocks, T_len, K, kh, G, Dh, block_size,
                 scores.data(), acc.data());
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < Dh; ++d) out[(b * H + kh * G + g) * Dh + d] = static_cast<T>(acc[g * Dh + d]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 4 && kv_cache.size(0) == 2, "q [B, H, Dh], kv_cache [2, S, K, Dh]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and the pool must share a dtype");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "contiguous pool and tables expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  const int64_t B = q.size(0), H = q.size(1), Dh = q.size(2), S = kv_cache.size(1), K = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == Dh && H % K == 0, "head dims must agree and K must divide H");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.numel() == B, "one table and one length per sequence");
  torch::Tensor qc = q.contiguous();
  torch::Tensor out = torch::empty_like(qc);
  const int64_t max_blocks = block_tables.size(1);
  const auto* tables = block_tables.data_ptr<int64_t>();
  const auto* lens = context_lens.data_ptr<int64_t>();
  switch (q.scalar_type()) {
    case at::kFloat:
      attend(qc.data_ptr<float>(), kv_cache.data_ptr<float>(), tables, lens, out.data_ptr<float>(), B, H, K, Dh, S,
             max_blocks, block_size, static_cast<float>(scale));
      break;
    case at::kBFloat16:
      attend(qc.data_ptr<at::BFloat16>(), kv_cache.data_ptr<at::BFloat16>(), tables, lens, out.data_ptr<at::BFloat16>(),
             B, H, K, Dh, S, max_blocks, block_size, static_cast<float>(scale));
      break;
    case at::kHalf:
      attend(qc.data_ptr<at::Half>(), kv_cache.data_ptr<at::Half>(), tables, lens, out.data_ptr<at::Half>(), B, H, K,
             Dh, S, max_blocks, block_size, static_cast<float>(scale));
      break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}
