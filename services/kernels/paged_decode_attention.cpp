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
// heads that share it, which is all decode attention must read.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

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
      const int64_t* table = block_tables + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)  // this kv head's query heads, scaled once
        for (int64_t d = 0; d < Dh; ++d) qf[g * Dh + d] = to_float(q[(b * H + kh * G + g) * Dh + d]) * scale;
      scores.assign(G * T_len, 0.f);  // [G, T]
      std::vector<float> maxes(G, -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < T_len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* k = keys + (slot * K + kh) * Dh;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * Dh;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < Dh; ++d) s += qg[d] * to_float(k[d]);
          scores[g * T_len + t] = s;
          maxes[g] = std::max(maxes[g], s);
        }
      }
      std::vector<float> sums(G, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < T_len; ++t) {
          float& p = scores[g * T_len + t];
          p = std::exp(p - maxes[g]);
          sums[g] += p;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < T_len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* v = values + (slot * K + kh) * Dh;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * T_len + t];
          float* a = acc.data() + g * Dh;
#pragma omp simd
          for (int64_t d = 0; d < Dh; ++d) a[d] += p * to_float(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < Dh; ++d) out[(b * H + kh * G + g) * Dh + d] = static_cast<T>(acc[g * Dh + d] / sums[g]);
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
