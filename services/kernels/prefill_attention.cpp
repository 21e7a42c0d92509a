// Causal prefill attention read straight from the paged KV pool: the new tokens of one sequence
// attend to its whole context (a cached prefix, then themselves), every key and value found through
// the sequence's block table, never gathered out of the pool first.
//
// Legend: T new tokens (queries), C context length (cached prefix + the T new tokens, all already
// in the pool), H query heads, K kv heads (G = H / K query heads share one), Dh head dim, S pool
// slots, N keys per key block (64), M query positions per task, R = M * G query rows per task,
// Pr elements per 32-bit lane of a packed operand (2 for bf16 pairs, 1 for float32).
//   q:           [T, H, Dh]    float32 / bfloat16 / float16, rows strided (a view of the fused qkv
//                              product is read in place); query j sits at position C - T + j
//   kv_cache:    [2, S, K, Dh] same dtype (keys, then values; one layer)
//   block_table: [max_blocks]  int64 (the sequence's pool blocks, ceil(C / block_size) used)
//   out:         [T, H, Dh]    q's dtype
//
// Flash style: a task is one kv head and M consecutive query positions, i.e. R query rows (the G
// heads sharing that kv head at each position); it walks the key blocks up to its last position,
// keeping a running maximum and sum per row (online softmax, float32) and the output rows in float32.
// The keys and values are first packed once per call, block by block, into the order the products
// read: with AVX-512 BF16, vdpbf16ps multiplies a broadcast pair of query (or probability) elements
// by 16 key columns' pairs at once, accumulating 16 float32 scores (or output elements); elsewhere
// the same loops run on float32 with FMAs (AVX-512 or AVX2; elsewhere scalar code, which the compiler
// vectorizes). The products are pair_gemm.h's; on a CPU with AMX, with bf16 pairs and Dh a multiple of 32, the tile
// unit's (prefill_tiles.h, the same operands).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "pair_gemm.h"
#include "prefill_softmax.h"
#include "prefill_tiles.h"
#include "softmax_math.h"
#include "vec_load.h"

namespace {

using pair_gemm::gemm;
using pair_gemm::kPair;
using prefill_softmax::kKeys;


// Key block kb of kv head kh, packed for the products: kp [Dh / Pr, N, Pr] (the scores' b: keys are
// its columns) and vp [N / Pr, Dh, Pr] (the outputs' b: head dims are its columns). Positions at or
// past C are zeros, so the pool slots past the context are never read.
template <typename E, typename T>
void pack_block(const T* keys, const T* values, const int64_t* table, int64_t block_size, int64_t K, int64_t kh,
                int64_t Dh, int64_t kb, int64_t C, E* kp, E* vp) {
  constexpr int64_t Pr = kPair<E>;
  const T* krows[kKeys];  // each key's row [Dh] in the pool; nullptr past the context
  const T* vrows[kKeys];
  for (int64_t n = 0; n < kKeys; ++n) {
    const int64_t pos = kb * kKeys + n;
    const int64_t slot = pos < C ? table[pos / block_size] * block_size + pos % block_size : -1;
    krows[n] = slot < 0 ? nullptr : keys + (slot * K + kh) * Dh;
    vrows[n] = slot < 0 ? nullptr : values + (slot * K + kh) * Dh;
  }
  if constexpr (std::is_same_v<E, T>) {  // the pool holds E already: copies, no rounding
    for (int64_t n = 0; n < kKeys; ++n)  // a key's Pr elements at a time, one per column of keys
      for (int64_t d = 0; d < Dh; d += Pr) {
        if (krows[n] != nullptr) std::memcpy(kp + d * kKeys + n * Pr, krows[n] + d, Pr * sizeof(E));
        else std::memset(kp + d * kKeys + n * Pr, 0, Pr * sizeof(E));
      }
#if defined(__AVX512BF16__)
    if constexpr (Pr == 2) {
      if (Dh % 16 == 0) {  // values 16 pairs at a time: key n in each 32-bit lane's low half, n + 1 in its high
        auto half = [](const T* row, int64_t d) {  // 16 elements, each in the low half of a 32-bit lane
          return row == nullptr ? _mm512_setzero_si512()
                                : _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
        };
        for (int64_t n = 0; n < kKeys; n += 2)
          for (int64_t d = 0; d < Dh; d += 16)
            _mm512_storeu_si512(vp + n * Dh + d * 2,
                                _mm512_or_si512(half(vrows[n], d), _mm512_slli_epi32(half(vrows[n + 1], d), 16)));
        return;
      }
    }
#endif
    for (int64_t n = 0; n < kKeys; ++n)
      for (int64_t d = 0; d < Dh; ++d) {
        E* dst = vp + (n / Pr) * Dh * Pr + d * Pr + n % Pr;
        if (vrows[n] != nullptr) std::memcpy(dst, vrows[n] + d, sizeof(E));
        else std::memset(dst, 0, sizeof(E));
      }
    return;
  }
  for (int64_t n = 0; n < kKeys; ++n)
    for (int64_t d = 0; d < Dh; ++d) {
      kp[(d / Pr) * kKeys * Pr + n * Pr + d % Pr] = static_cast<E>(krows[n] ? scalar_to_float(krows[n][d]) : 0.f);
      vp[(n / Pr) * Dh * Pr + d * Pr + n % Pr] = static_cast<E>(vrows[n] ? scalar_to_float(vrows[n][d]) : 0.f);
    }
}

template <typename T, typename E>
void attend(const T* q, int64_t q_token_stride, int64_t q_head_stride, const T* cache, const int64_t* table, T* out,
            int64_t T_len, int64_t C, int64_t H, int64_t K, int64_t Dh, int64_t S, int64_t block_size, float scale) {
  const int64_t G = H / K, first = C - T_len;  // first: the position of query 0
  const T* keys = cache;  // [S, K, Dh]
  const T* values = cache + S * K * Dh;  // [S, K, Dh]
  const int64_t key_blocks = (C + kKeys - 1) / kKeys, block_elems = kKeys * Dh;
  const auto elem = std::is_same_v<E, float> ? at::kFloat : at::kBFloat16;
  // kp, vp: [K, key_blocks, N * Dh] each, the pack_block layouts
  at::Tensor packed = at::empty({2, K, key_blocks, block_elems}, at::TensorOptions().dtype(elem));
  E* kp = reinterpret_cast<E*>(packed.data_ptr());
  E* vp = kp + K * key_blocks * block_elems;
  at::parallel_for(0, K * key_blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      pack_block(keys, values, table, block_size, K, i / key_blocks, Dh, i % key_blocks, C, kp + i * block_elems,
                 vp + i * block_elems);
  });
  const int64_t M = std::max<int64_t>(1, 64 / G), R_max = M * G;  // ~64 rows per task
  const int64_t query_blocks = (T_len + M - 1) / M, tasks = K * query_blocks;
  std::atomic<int64_t> next{0};  // tasks handed out longest first (the last positions see the most keys)
#if defined(PDSERVE_PREFILL_TILES)
  const bool on_tiles = std::is_same_v<E, at::BFloat16> && prefill_tiles::supports(Dh);
#endif
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
#if defined(PDSERVE_PREFILL_TILES)
    prefill_tiles::Gemm tile_gemm;
#endif
    // c (+)= a . b (pair_gemm's contract); on the tiles a whole step of 16 pairs at a time: the values' product then
    // reads p's columns past `cols` too, which the softmax left zero
    auto product = [&](const E* a, int64_t lda, const E* b, int64_t ldb, int64_t steps, float* c, int64_t ldc,
                       int64_t rows, int64_t cols, bool add) {
#if defined(PDSERVE_PREFILL_TILES)
      if constexpr (std::is_same_v<E, at::BFloat16>) {
        if (on_tiles) return tile_gemm(a, lda, b, ldb, (steps + 15) / 16 * 16, c, ldc, rows, cols, add);
      }
#endif
      gemm(a, lda, b, ldb, steps, c, ldc, rows, cols, add);
    };
    std::vector<E> qt(R_max * Dh), p(R_max * kKeys);  // [R, Dh], [R, N]
    std::vector<float> o(R_max * Dh), s(R_max * kKeys), maxes(R_max), sums(R_max * 16);  // [R, Dh], [R, N], [R], [R, 16]
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t qb = query_blocks - 1 - task / K, kh = task % K;
      const int64_t j0 = qb * M, rows_m = std::min(M, T_len - j0), R = rows_m * G;  // queries j0 .. j0 + rows_m - 1
      for (int64_t r = 0; r < R; ++r) {  // row r = position j0 + r / G, head kh G + r % G
        const T* src = q + (j0 + r / G) * q_token_stride + (kh * G + r % G) * q_head_stride;
        for (int64_t d = 0; d < Dh; ++d) qt[r * Dh + d] = static_cast<E>(scalar_to_float(src[d]));
      }
      std::fill(o.begin(), o.begin() + R * Dh, 0.f);
      std::fill(maxes.begin(), maxes.begin() + R, -std::numeric_limits<float>::infinity());
      std::fill(sums.begin(), sums.begin() + R * 16, 0.f);
      const int64_t last = first + j0 + rows_m - 1;  // the task's last position: keys 0 .. last
      for (int64_t kb = 0; kb <= last / kKeys; ++kb) {
        const E* kblock = kp + (kh * key_blocks + kb) * block_elems;
        const E* vblock = vp + (kh * key_blocks + kb) * block_elems;
        // the keys up to the task's last position, in whole vectors: fewer on the diagonal block
        const int64_t cols = std::min(kKeys, (last - kb * kKeys + 16) / 16 * 16);
        product(qt.data(), Dh, kblock, kKeys * kPair<E>, Dh / kPair<E>, s.data(), kKeys, R, cols, false);  // s = q k^T
        prefill_softmax::softmax_rows(  // row r sees keys up to its own position
            s.data(), R, [&](int64_t r) { return first + j0 + r / G - kb * kKeys + 1; }, scale, maxes.data(),
            sums.data(), p.data(), o.data(), Dh);
        product(p.data(), kKeys, vblock, Dh * kPair<E>, cols / kPair<E>, o.data(), Dh, R, Dh, true);  // o += p v
      }
      for (int64_t r = 0; r < R; ++r) {
        T* dst = out + ((j0 + r / G) * H + kh * G + r % G) * Dh;
        const float sum = std::accumulate(sums.begin() + r * 16, sums.begin() + (r + 1) * 16, 0.f);
        for (int64_t d = 0; d < Dh; ++d) dst[d] = static_cast<T>(o[r * Dh + d] / sum);
      }
    }
  });
}

template <typename T>  // bf16 pairs where vdpbf16ps exists, float32 elsewhere
void dispatch(const torch::Tensor& q, const torch::Tensor& cache, const int64_t* table, torch::Tensor& out,
              int64_t C, int64_t block_size, float scale) {
  const int64_t T_len = q.size(0), H = q.size(1), Dh = q.size(2), S = cache.size(1), K = cache.size(2);
  auto run = [&](auto packed) {
    attend<T, decltype(packed)>(q.data_ptr<T>(), q.stride(0), q.stride(1), cache.data_ptr<T>(), table,
                                out.data_ptr<T>(), T_len, C, H, K, Dh, S, block_size, scale);
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (Dh % 2 == 0) return run(at::BFloat16());
  }
#endif
  run(0.f);
}

}  // namespace

// Turns prefill_tiles.h's products on or off (where the build has them); returns whether they were on (false: not
// built).
bool set_prefill_attention_tiles(bool on) {
#if defined(PDSERVE_PREFILL_TILES)
  return prefill_tiles::on.exchange(on);
#else
  (void)on;
  return false;
#endif
}

torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
                                int64_t context_len, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 4 && kv_cache.size(0) == 2, "q [T, H, Dh], kv_cache [2, S, K, Dh]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and the pool must share a dtype");
  TORCH_CHECK(kv_cache.is_contiguous() && block_table.is_contiguous(), "contiguous pool and block table expected");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong, "block_table [max_blocks] int64");
  const int64_t T_len = q.size(0), H = q.size(1), Dh = q.size(2), S = kv_cache.size(1), K = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == Dh && H % K == 0, "head dims must agree and K must divide H");
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);  // the running maxima are of unscaled scores
  TORCH_CHECK(block_size > 0 && S % block_size == 0, "block_size ", block_size, " must divide the pool's ", S, " slots");
  TORCH_CHECK(T_len >= 1 && context_len >= T_len, "context_len ", context_len, " must cover the ", T_len, " queries");
  const int64_t used = (context_len + block_size - 1) / block_size;
  TORCH_CHECK(used <= block_table.numel(), "context_len ", context_len, " needs ", used, " blocks, the table has ",
              block_table.numel());
  const auto* table = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < used; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < S / block_size, "block ", table[b], " is outside the pool");
  const torch::Tensor qs = q.stride(2) == 1 ? q : q.contiguous();  // whole rows; tokens and heads may be strided
  torch::Tensor out = torch::empty({T_len, H, Dh}, q.options());
  const float sc = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch<float>(qs, kv_cache, table, out, context_len, block_size, sc); break;
    case at::kBFloat16: dispatch<at::BFloat16>(qs, kv_cache, table, out, context_len, block_size, sc); break;
    case at::kHalf: dispatch<at::Half>(qs, kv_cache, table, out, context_len, block_size, sc); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}
