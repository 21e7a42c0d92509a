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
// heads that share it, which is all decode attention must read. A bf16 pool (Dh a multiple of 32) is multiplied
// by the tile unit on a CPU with AMX (decode_tiles.h), in bf16 pairs on one with AVX512-BF16 (decode_pairs.h);
// otherwise, with AVX-512 and Dh a multiple of 16, each key and value row is loaded once as float32 vectors and the
// softmax's exp is a polynomial on 16 scores at a time (decode_tokens.h, decode_runs.h); with AVX2 (no AVX-512) the
// context goes 16 tokens at a time with an online softmax (decode_blocks.h); elsewhere decode_tokens.h's loops run
// scalar (the compiler vectorizes what it can).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "decode_blocks.h"
#include "decode_pairs.h"
#include "decode_tiles.h"
#include "decode_runs.h"
#include "decode_tokens.h"
#include "vec_load.h"

namespace {

#if defined(PDSERVE_DECODE_BLOCKS)
// decode_tokens.h attend_task's work on AVX2 CPUs (decode_blocks.h): the context a chunk of at most kChunk tokens at a time,
// every kv head of the task within each chunk (so a task of whole token rows reads each block as one run).
template <typename T>
void attend_task_chunks(const float* qf, const T* keys, const T* values, const int64_t* table, int64_t T_len,
                        int64_t K, int64_t kh0, int64_t nkh, int64_t G, int64_t Dh, int64_t block_size, float* acc) {
  using decode_blocks::kChunk;
  const int64_t Q = nkh * G;
  std::vector<decode_blocks::HeadState> heads(Q);
  for (int64_t h = 0; h < Q; ++h) heads[h].acc = acc + h * Dh;
  std::fill(acc, acc + Q * Dh, 0.f);
  alignas(32) float kf[kChunk * 256];
  std::vector<float> p(G * kChunk);
  // chunk i: block i / per_block, its tokens from (i % per_block) * kChunk on; its first row's offset (head kh0)
  const int64_t per_block = (block_size + kChunk - 1) / kChunk;
  auto chunk_at = [&](int64_t i, int64_t* first) {  // -> its token count (0: past the context)
    const int64_t b = i / per_block, c = i % per_block * kChunk, start = b * block_size + c;
    if (start >= T_len) return int64_t{0};
    *first = ((table[b] * block_size + c) * K + kh0) * Dh;
    return std::min({kChunk, block_size - c, T_len - start});
  };
  int64_t first = 0, next_first = 0, n = chunk_at(0, &first);
  for (int64_t i = 0; n > 0; ++i, first = next_first) {
    const int64_t next_n = chunk_at(i + 1, &next_first);
    for (int64_t j = 0; j < nkh; ++j) {
      // the next chunk's rows of this head, fetched while this one computes: its blocks are scattered through the
      // pool, a new stream every kChunk rows that the hardware prefetchers would first have to miss on
      for (int64_t t = 0; t < next_n; ++t)
        for (int64_t at = 0; at < Dh * static_cast<int64_t>(sizeof(T)); at += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(keys + next_first + t * K * Dh + j * Dh) + at);
          __builtin_prefetch(reinterpret_cast<const char*>(values + next_first + t * K * Dh + j * Dh) + at);
        }
      decode_blocks::chunk(qf + j * G * Dh, keys + first + j * Dh, values + first + j * Dh, K * Dh, n, G, Dh,
                           heads.data() + j * G, kf, p.data());
    }
    n = next_n;
  }
  for (int64_t h = 0; h < Q; ++h)
    for (int64_t d = 0; d < Dh; ++d) acc[h * Dh + d] /= heads[h].l;
}
#endif

#if defined(PDSERVE_DECODE_TILES)
// Whether a bf16 pool's tasks take decode_tiles.h's path (AMX) where it runs; else decode_pairs.h's. A process-wide
// switch (set_decode_attention_tiles) so tests and benchmarks compare the two in one process.
std::atomic<bool> decode_tiles_on{true};
#endif

// A task on decode_tiles.h's path (AMX), else on decode_pairs.h's, where one takes it (a bf16 pool on an AVX512-BF16
// CPU, Dh a multiple of 32 up to 256; q: the task's [Q, Dh] query heads, unscaled): whether it did.
template <typename T>
bool attend_in_bf16(const T*, float, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                     int64_t, int64_t, std::vector<float>&, float*) {
  return false;
}
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline bool attend_in_bf16(const at::BFloat16* q, float scale, const at::BFloat16* keys, const at::BFloat16* values,
                            const int64_t* table, int64_t T_len, int64_t K, int64_t kh0, int64_t nkh, int64_t G,
                            int64_t Dh, int64_t block_size, std::vector<float>& scores, float* acc) {
#if defined(PDSERVE_DECODE_TILES)
  if (decode_tiles_on && decode_tiles::supports(Dh, G)) {
    decode_tiles::attend_task_dh(Dh, q, scale, keys, values, table, T_len, K, kh0, nkh, G, block_size, scores, acc);
    return true;
  }
#endif
  if (!decode_pairs::supports(Dh)) return false;
  decode_pairs::attend_task_dh(Dh, q, scale, keys, values, table, T_len, K, kh0, nkh, G, block_size, scores, acc);
  return true;
}
#endif

template <typename T>
void attend(const T* q, const T* cache, const int64_t* block_tables, const int64_t* context_lens, T* out, int64_t B,
            int64_t H, int64_t K, int64_t Dh, int64_t S, int64_t max_blocks, int64_t block_size, float scale) {
  const int64_t G = H / K;
  const T* keys = cache;  // [S, K, Dh]
  const T* values = cache + S * K * Dh;  // [S, K, Dh]
  // Tasks of as many kv heads as keep every thread busy. A batch no larger than the threads: the fewest tasks that
  // split evenly among them (batch 1 on 2 threads: 2 tasks of 4 of 8 heads, each token's slice a 512-byte run; a
  // head per task, 8 tasks, read 128 bytes of each 1 KB row and waited on memory: 1.2-1.7x slower from memory, 1b
  // shapes, AMD EPYC Zen 4). Larger batches: ~4 tasks each, a whole token row per task once the batch is large.
  // Each head's arithmetic is the same however the heads are grouped: the results do not depend on this choice.
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 0;
  if (B <= threads)
    for (int64_t c = 1; c <= K && chunks == 0; ++c)
      if (K % c == 0 && B * c >= threads && B * c % threads == 0) chunks = c;
  if (chunks == 0) {
    const int64_t wanted = std::max<int64_t>(1, 4 * threads / std::max<int64_t>(B, 1));
    chunks = 1;
    while (chunks < std::min(wanted, K) || K % chunks != 0) ++chunks;
  }
  const int64_t nkh = K / chunks;
  at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nkh * G * Dh), acc(nkh * G * Dh), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, kh0 = (task % chunks) * nkh, T_len = context_lens[b];
      const int64_t h0 = kh0 * G, Q = nkh * G;  // query heads h0 .. h0 + Q - 1
      const int64_t* table = block_tables + b * max_blocks;
      if (!attend_in_bf16(q + (b * H + h0) * Dh, scale, keys, values, table, T_len, K, kh0, nkh, G, Dh, block_size,
                           scores, acc.data())) {
        for (int64_t h = 0; h < Q; ++h)  // scaled once
          for (int64_t d = 0; d < Dh; ++d) qf[h * Dh + d] = scalar_to_float(q[(b * H + h0 + h) * Dh + d]) * scale;
#if defined(PDSERVE_DECODE_BLOCKS)
        if (decode_blocks::supports(Dh)) {
          attend_task_chunks(qf.data(), keys, values, table, T_len, K, kh0, nkh, G, Dh, block_size, acc.data());
        } else
#endif
        {
          scores.resize(Q * T_len);
          decode_tokens::attend_task(qf.data(), keys, values, table, T_len, K, kh0, nkh, G, Dh, block_size,
                                     scores.data(), acc.data());
        }
      }
      for (int64_t h = 0; h < Q; ++h)
        for (int64_t d = 0; d < Dh; ++d) out[(b * H + h0 + h) * Dh + d] = static_cast<T>(acc[h * Dh + d]);
    }
  });
}

}  // namespace

// Turns decode_tiles.h's path on or off (where the build has it); returns whether it was on (false: not built).
bool set_decode_attention_tiles(bool on) {
#if defined(PDSERVE_DECODE_TILES)
  return decode_tiles_on.exchange(on);
#else
  (void)on;
  return false;
#endif
}

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
