// Decode attention over a bf16 pool on CPUs with AMX: a run's scores and its values' weighing as tile products
// (tdpbf16ps), the softmax between them decode_pairs.h's (same buffers, same rounding of the probabilities to bf16).
//
// Legend: G query heads sharing one kv head (<= 16), nkh kv heads of a task, Q = nkh * G, Dh head dim (a multiple of
// 32, at most 256: DP = Dh / 32 steps of 32 dims), n <= kRun = 16 tokens of a run (one tile of tokens).
//   q:      [Q, Dh]                bf16, unscaled, the task's query heads
//   qb:     [nkh, DP, 16, 16]      int32: kv head j's heads' pairs (q[g, 32c + 2r], q[g, 32c + 2r + 1]) in columns
//                                  (j % per_c) G + g, zeros in the others (per_c = 16 / G kv heads share a C tile):
//                                  tiles 1, 4 (even / odd steps)
//   K rows: [16, 32] bf16          a run's key rows, one step of dims, loaded from the pool where they lie (rows
//                                  K * Dh apart; a run shorter than 16 from a zero-padded copy): tiles 0, 3
//   scores: [R, Q, kRun]           float32 (decode_pairs.h): tile 2 ([16 tokens, per_c G] per group of per_c kv
//                                  heads) transposed into it,
//                                  then in place the bf16 probabilities: G heads x 16 tokens, 64 bytes apart: tile 3
//   vb:     [nkh, 2 DP, 8, 16]     int32 per run: token pairs (v[2i, d], v[2i + 1, d]) of 16 dims in pair order
//                                  (decode_pairs.h weigh_pairs): tile 4
//   acc:    [Q, Dh]                float32, in pair order until normalized: tile 5, G rows x 16 dims at a time
//
// Why: on an Intel Xeon with AMX (2 threads), the pairs path's batch-32 x 1,024-token bf16 layer took ~2.9 ms from
// the caches against ~2.0 ms to read its 67 MB from memory: vdpbf16ps's arithmetic, and the 45-instruction tree that
// sums a run's 16 key products per head. The tile unit multiplies a run's 16 keys by G heads in one instruction a
// step of 32 dims, with no sums across lanes.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define PDSERVE_DECODE_TILES 1
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "decode_pairs.h"
#include "decode_runs.h"
#include "tile_state.h"
#include "transpose16.h"

namespace decode_tiles {

using decode_runs::kRun;

inline bool supports(int64_t Dh, int64_t G) {
  return decode_pairs::supports(Dh) && G >= 1 && G <= 16 && tile_state::granted();
}

// Tiles of the scores: 0 and 3 key rows (A), 1 and 4 q's pairs (B), 2 a group's scores (C).
inline void load_score_tiles() {
  tile_state::Config().tile(0, 16, 64).tile(1, 16, 64).tile(2, 16, 64).tile(3, 16, 64).tile(4, 16, 64).load();
}

// A run's n value rows v + c * stride (one kv head's Dh dims; rows past n: zeros) as token pairs in pair order:
// to [2 DP, kRun / 2, 16] int32, tile t = 2s + half the dims of decode_pairs' weigh_pairs register 2s + half.
template <int DP>
__attribute__((always_inline)) inline void value_pairs(const at::BFloat16* v, int64_t stride, int64_t n, int32_t* to) {
  for (int64_t i = 0; i < kRun / 2; ++i)
    for (int64_t s = 0; s < DP; ++s) {
      const at::BFloat16* row = v + 2 * i * stride + 32 * s;
      const __m512i even = 2 * i < n ? _mm512_loadu_si512(row) : _mm512_setzero_si512();
      const __m512i odd = 2 * i + 1 < n ? _mm512_loadu_si512(row + stride) : _mm512_setzero_si512();
      _mm512_storeu_si512(to + ((2 * s) * kRun / 2 + i) * 16, _mm512_unpacklo_epi16(even, odd));
      _mm512_storeu_si512(to + ((2 * s + 1) * kRun / 2 + i) * 16, _mm512_unpackhi_epi16(even, odd));
    }
}

// The values weighed for Dh <= 64 (2 DP <= 4 tiles of 16 dims), one kv head at a time, its sums kept in tiles 0 ..
// 2 DP - 1 over every run (4 A tile of probabilities, 5 B tile of value pairs). Each run's pairs are made while the
// previous run's products run: a tile load right after the stores of its own bytes waits on them. Why: reloading and
// storing each run's sums cost ~35 cycles a tile operation (1b shapes, 32 x 1,024 tokens: 2 of a layer's ~4 ms).
template <int DP>
void weigh_in_tiles(const float* scores, const at::BFloat16* values, const int64_t* table, int64_t T_len, int64_t K,
                    int64_t kh0, int64_t nkh, int64_t G, int64_t block_size, float* acc) {
  constexpr int64_t Dh = 32 * DP, kPairsInts = 2 * DP * kRun / 2 * 16;
  const int64_t Q = nkh * G, stride = K * Dh;
  tile_state::Config config;
  for (int t = 0; t < 4; ++t) config.tile(t, G, 64);
  config.tile(4, G, 2 * kRun).tile(5, kRun / 2, 64).load();
  alignas(64) int32_t pairs[2][kPairsInts];
  for (int64_t j = 0; j < nkh; ++j) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (DP == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    auto multiply = [&](int64_t r) {  // run r's products, its pairs made one run earlier
      const int32_t* vb = pairs[r % 2];
      _tile_loadd(4, scores + (r * Q + j * G) * kRun, kRun * 4);
      _tile_loadd(5, vb, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, vb + kRun / 2 * 16, 64);
      _tile_dpbf16ps(1, 4, 5);
      if constexpr (DP == 2) {
        _tile_loadd(5, vb + 2 * kRun / 2 * 16, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, vb + 3 * kRun / 2 * 16, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    };
    int64_t r = 0;
    decode_runs::for_each_run(values, table, T_len, K, kh0 + j, Dh, Dh, block_size,
                              [&](int64_t, const at::BFloat16* first, int64_t n,
                                  const decode_runs::NextRun<at::BFloat16>& next) {
      next.fetch(0, 1);
      value_pairs<DP>(first, stride, n, pairs[r % 2]);
      if (r > 0) multiply(r - 1);
      ++r;
    });
    if (r > 0) multiply(r - 1);
    float* out = acc + j * G * Dh;
    _tile_stored(0, out, Dh * 4);
    _tile_stored(1, out + 16, Dh * 4);
    if constexpr (DP == 2) {
      _tile_stored(2, out + 32, Dh * 4);
      _tile_stored(3, out + 48, Dh * 4);
    }
  }
}

// One task (decode_pairs' attend_task contract): acc [Q, Dh] = softmax(scale q . k) v, normalized, in column order.
template <int DP>
void attend_task(const at::BFloat16* q, float scale, const at::BFloat16* keys, const at::BFloat16* values,
                 const int64_t* table, int64_t T_len, int64_t K, int64_t kh0, int64_t nkh, int64_t G,
                 int64_t block_size, std::vector<float>& scores, float* acc) {
  constexpr int64_t Dh = 32 * DP;
  const int64_t Q = nkh * G, stride = K * Dh;
  const int64_t runs = (T_len + block_size - 1) / block_size * ((block_size + kRun - 1) / kRun);
  scores.resize(runs * Q * kRun);
  // kv heads whose query heads share the 16 columns of one C tile: each one's B tiles hold its G columns and zeros,
  // so a group's products add into one tile, stored and transposed once for all of them. Why: per kv head, the
  // store, the 16 loads and the 16 x 16 transpose of a tile with G = 4 live columns were 2-7% of a 32 x 1,024-token
  // layer (Intel Xeon, family 6 model 207); the zero columns add exact zeros, so the scores are the same bits.
  const int64_t per_c = std::min<int64_t>(nkh, 16 / G);
  std::vector<int32_t> qb(nkh * DP * 16 * 16, 0);
  const int32_t* q_pairs = reinterpret_cast<const int32_t*>(q);  // head h's pair i: q_pairs[h * Dh / 2 + i]
  for (int64_t j = 0; j < nkh; ++j)
    for (int64_t c = 0; c < DP; ++c)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t g = 0; g < G; ++g)
          qb[((j * DP + c) * 16 + r) * 16 + (j % per_c) * G + g] = q_pairs[(j * G + g) * Dh / 2 + 16 * c + r];
  load_score_tiles();
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scales = _mm512_set1_ps(scale);
  std::vector<float> head_max(Q, -std::numeric_limits<float>::infinity());  // scaled
  alignas(64) at::BFloat16 padded[kRun * Dh];  // a short run's key rows, zeros past n
  alignas(64) float run_scores[kRun * 16];  // tile 2: [16 tokens, 16 columns]
  int64_t r = 0;
  decode_runs::for_each_run(keys, table, T_len, K, kh0, nkh * Dh, Dh, block_size,
                            [&](int64_t, const at::BFloat16* first, int64_t n,
                                const decode_runs::NextRun<at::BFloat16>& next) {
    float* run = scores.data() + r++ * Q * kRun;
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t j0 = 0; j0 < nkh; j0 += per_c) {
      const int64_t group = std::min(per_c, nkh - j0);
      _tile_zero(2);
      for (int64_t j = j0; j < j0 + group; ++j) {
        next.fetch(j, nkh);
        const at::BFloat16* k = first + j * Dh;
        int64_t k_stride = stride;
        if (n < kRun) {  // rows past the run may lie past the pool's end
          for (int64_t t = 0; t < kRun; ++t)
            if (t < n) std::memcpy(padded + t * Dh, k + t * stride, Dh * sizeof(at::BFloat16));
            else std::memset(padded + t * Dh, 0, Dh * sizeof(at::BFloat16));
          k = padded, k_stride = Dh;
        }
        for (int64_t c = 0; c < DP; ++c) {  // alternate tiles: a load need not wait on the product before it
          const int32_t* qc = qb.data() + (j * DP + c) * 256;
          if (c % 2 == 0) {
            _tile_loadd(0, k + 32 * c, k_stride * 2);
            _tile_loadd(1, qc, 64);
            _tile_dpbf16ps(2, 0, 1);
          } else {
            _tile_loadd(3, k + 32 * c, k_stride * 2);
            _tile_loadd(4, qc, 64);
            _tile_dpbf16ps(2, 3, 4);
          }
        }
      }
      _tile_stored(2, run_scores, 64);
      __m512i rows[16], columns[16];
      for (int t = 0; t < 16; ++t) rows[t] = _mm512_load_si512(run_scores + 16 * t);
      // the group's heads' maxima over the run's live tokens, taken across the rows before the transpose: one
      // vector for its heads, where per head it was a load, a max and a store (the scale is positive and its
      // rounding monotonic: max(s) scale = max(s scale), the same bits)
      __m512 run_max = _mm512_castsi512_ps(rows[0]);
      for (int64_t t = 1; t < n; ++t) run_max = _mm512_max_ps(run_max, _mm512_castsi512_ps(rows[t]));
      const __mmask16 heads = static_cast<__mmask16>((1u << (group * G)) - 1);
      float* max_at = head_max.data() + j0 * G;
      run_max = _mm512_max_ps(_mm512_maskz_loadu_ps(heads, max_at), _mm512_mul_ps(run_max, scales));
      _mm512_mask_storeu_ps(max_at, heads, run_max);
      transpose16(rows, columns);  // columns[c]: column c's 16 scores: head j0 G + c
      for (int64_t c = 0; c < group * G; ++c) {
        const __m512 s = _mm512_mul_ps(_mm512_castsi512_ps(columns[c]), scales);
        _mm512_storeu_ps(run + (j0 * G + c) * kRun, n == kRun ? s : _mm512_mask_mov_ps(minus_inf, live, s));
      }
    }
  });
  std::vector<float> maxes(Q * kRun);  // numerators' lane-wise maxima: each head's in all lanes
  for (int64_t h = 0; h < Q; ++h) _mm512_storeu_ps(maxes.data() + h * kRun, _mm512_set1_ps(head_max[h]));
  std::vector<float> sums(Q);
  decode_pairs::numerators(scores.data(), r, Q, maxes.data(), sums.data());
  if constexpr (DP <= 2) {
    weigh_in_tiles<DP>(scores.data(), values, table, T_len, K, kh0, nkh, G, block_size, acc);
  } else {
    std::fill(acc, acc + Q * Dh, 0.f);
    r = 0;
    // tiles 3 probabilities (A), 4 values' pairs (B), 5 sums (C)
    tile_state::Config().tile(3, G, 2 * kRun).tile(4, kRun / 2, 64).tile(5, G, 64).load();
    std::vector<int32_t> vb(nkh * 2 * DP * kRun / 2 * 16);
    decode_runs::for_each_run(values, table, T_len, K, kh0, nkh * Dh, Dh, block_size,
                              [&](int64_t, const at::BFloat16* first, int64_t n,
                                  const decode_runs::NextRun<at::BFloat16>& next) {
      const float* run = scores.data() + r++ * Q * kRun;
      // every kv head's value pairs first, then the tile products: a tile load right after the stores of its own
      // bytes waits on them
      for (int64_t j = 0; j < nkh; ++j) {
        next.fetch(j, nkh);
        value_pairs<DP>(first + j * Dh, stride, n, vb.data() + j * 2 * DP * kRun / 2 * 16);
      }
      for (int64_t j = 0; j < nkh; ++j) {
        _tile_loadd(3, run + j * G * kRun, kRun * 4);
        for (int64_t t = 0; t < 2 * DP; ++t) {
          float* sums_at = acc + j * G * Dh + 16 * t;
          _tile_loadd(4, vb.data() + (j * 2 * DP + t) * kRun / 2 * 16, 64);
          _tile_loadd(5, sums_at, Dh * 4);
          _tile_dpbf16ps(5, 3, 4);
          _tile_stored(5, sums_at, Dh * 4);
        }
      }
    });
  }
  _tile_release();
  decode_pairs::normalize(acc, sums.data(), Q, Dh);
}

// attend_task for a head dim chosen at run time (supports(Dh, G)).
inline void attend_task_dh(int64_t Dh, const at::BFloat16* q, float scale, const at::BFloat16* keys,
                           const at::BFloat16* values, const int64_t* table, int64_t T_len, int64_t K, int64_t kh0,
                           int64_t nkh, int64_t G, int64_t block_size, std::vector<float>& scores, float* acc) {
  decode_pairs::with_steps(Dh, [&](auto dp) {
    attend_task<decltype(dp)::value>(q, scale, keys, values, table, T_len, K, kh0, nkh, G, block_size, scores, acc);
  });
}

}  // namespace decode_tiles

#endif  // AMX
