// bf16, int8 or int4 weights times a batch of bf16 rows on CPUs with AMX: y = x @ W^T (+ bias), every product by the
// tile unit (tdpbf16ps, float32 sums), W read once per 32 rows of x.
//
// Legend: M rows of x, K input features (a multiple of 32), N output features, S = K / 32 steps, Mt = ceil(M / 16)
// tiles of x, NB = 32 W rows per block (two A tiles), a pass: up to two tiles of x against one block.
//   x:     [M, K]          bf16
//   W:     [N, K]          bf16; or int8 with scale [N] float32 (w_real[n, k] = w[n, k] * scale[n]); or group-wise
//                          int4 (packed [N, Kp / 2], scale and low [N, Kp / 32] float16: int4_block.h)
//   bias:  [N]             optional, float32 here (x's dtype in Python)
//   xb:    [S, Mt, 16, 16] int32: step s, tile t, row r, lane m the pair (x[16t + m, 32s + 2r], x[.., 32s + 2r + 1]),
//                          zeros past M: tdpbf16ps's B operand, packed once a call (for int8 and int4 W, x's
//                          columns first put in the order tile_chunks.h converts W's in, int4's over Kp columns)
//   A:     [16, 32]        bf16 per tile: 16 W rows x one step's columns, loaded from W itself (bf16, rows K * 2
//                          bytes apart) or from `converted` (tile_chunks.h's byte lookups: int8 exact, every int8
//                          fits bf16's 8 bits; int4 dequantized and rounded to bf16 as int4's prefill path does)
//   C:     [16, 16]        float32 per (A tile, B tile): W rows x rows of x, summed over the steps; tiles 0-3
//   y:     [M, N]          bf16: C transposed (16 x 16 lanes), scaled (int8), + bias, rounded once
//
// Tiles: 0-3 C (A tile a, B tile b: 2a + b), 4-5 A, 6-7 B.
//
// Why: a decode batch's products read W once and multiply it by every row; with 32 rows of x on an Intel Xeon with
// AMX (2 threads), oneDNN's packed bf16 product ran the `1b` preset's 65 products of a step at 24 GB/s against a
// 33 GB/s read ceiling, and the int8 weights' best (dequantize + product) at a fraction of it. Here the tile unit
// takes W's rows as they lie in memory (A operand: 16 rows, a stride), so nothing is transposed but x (once a call)
// and the [W rows, x rows] sums (once a product); each step's A loads are 32 rows x 64 bytes, each row a stream of
// its own, prefetched a few steps ahead by hand.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_rows.h"
#include "int4_block.h"
#include "thread_chunks.h"
#include "tile_state.h"
#include "transpose16.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
namespace {

using amx_rows::Bf16Rows, amx_rows::ChunkRows, amx_rows::Int4Chunks, amx_rows::Int8Chunks, amx_rows::kNB,
    amx_rows::kStep;

// Every tile used here: 16 rows of 64 bytes.
inline void load_tiles() {
  tile_state::Config config;
  for (int t = 0; t < 8; ++t) config.tile(t, 16, 64);
  config.load();
}

// sums [4][16][16]: tile 2a + b = W rows 16a.., x tile t0 + b; x tiles t0 and (if two) t0 + 1
template <typename Rows>
void pass(const Rows& rows, const int32_t* xb, int64_t S, int64_t Mt, int64_t t0, bool two, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < S; ++s) {
    rows.load(s);
    const int32_t* b = xb + (s * Mt + t0) * 256;
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, b + 256, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
  _tile_stored(2, sums + 512, 64);
  _tile_stored(3, sums + 768, 64);
}

// y's rows 16t + m (< M), columns n0 + 16a .. (< N): sums tile [16 W rows, 16 x rows] transposed, * scale, + bias
void store(const float* tile, int64_t t, int64_t M, int64_t n0, int64_t N, const float* scale, const float* bias,
           at::BFloat16* y) {
  __m512i in[16], out[16];
  for (int i = 0; i < 16; ++i) in[i] = _mm512_loadu_si512(tile + 16 * i);
  transpose16(in, out);
  const int64_t live = std::min<int64_t>(16, N - n0);
  const __mmask16 lanes = static_cast<__mmask16>((1u << live) - 1);
  const __m512 sc = scale ? _mm512_maskz_loadu_ps(lanes, scale + n0) : _mm512_set1_ps(1.f);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes, bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < 16 && 16 * t + m < M; ++m) {
    const __m512 v = _mm512_fmadd_ps(_mm512_castsi512_ps(out[m]), sc, b);  // scale 1, bias 0: v exactly
    _mm256_mask_storeu_epi16(y + (16 * t + m) * N + n0, lanes, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

template <typename MakeRows>
void product(const std::vector<int32_t>& xb, int64_t M, int64_t N, int64_t K, const float* scale, const float* bias,
             at::BFloat16* y, const MakeRows& make_rows) {
  const int64_t S = K / kStep, Mt = (M + 15) / 16, blocks = (N + kNB - 1) / kNB;
  parallel_chunks(blocks, [&](int64_t b0, int64_t b1) {
    load_tiles();
    alignas(64) float sums[4 * 256];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kNB;
      make_rows(n0, [&](const auto& rows) {  // every pass of x's tiles over the block's rows
        for (int64_t t0 = 0; t0 < Mt; t0 += 2) {
          const bool two = t0 + 1 < Mt;
          pass(rows, xb.data(), S, Mt, t0, two, sums);
          for (int64_t a = 0; a < 2 && n0 + 16 * a < N; ++a)
            for (int64_t b = 0; b < (two ? 2 : 1); ++b)
              store(sums + (2 * a + b) * 256, t0 + b, M, n0 + 16 * a, N, scale, bias, y);
        }
      });
    }
    _tile_release();
  });
}

}  // namespace

bool amx_ready() { return tile_state::granted(); }

// See the file's legend.
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                         const c10::optional<torch::Tensor>& low, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(tile_state::granted(), "this process was not granted the CPU's tile state (AMX)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be a CPU bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kStep == 0 && K > 0, "K must be a positive multiple of 32");
  const bool int4 = low.has_value();
  int64_t N;
  if (int4) {  // w: packed [N, Kp / 2] uint8, scale and low [N, Kp / 32] float16
    TORCH_CHECK(scale.has_value(), "int4 needs packed, scale and low");
    N = int4::check_product(x, w, *scale, *low).N;
  } else {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.is_contiguous() && w.device().is_cpu(),
                "w must be a contiguous CPU [N, K]");
    N = w.size(0);
    TORCH_CHECK(w.scalar_type() == at::kChar || w.scalar_type() == at::kBFloat16,
                "w must be bf16, int8 with scale, or int4 (packed) with scale and low");
    TORCH_CHECK((w.scalar_type() == at::kChar) == scale.has_value(),
                "scale [N] float32 goes with int8 w, and only with it");
    if (scale.has_value())
      TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == N && scale->is_contiguous(),
                  "scale must be a contiguous float32 [N]");
  }
  const bool int8 = !int4 && w.scalar_type() == at::kChar;
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have N elements");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  // x's pairs as B tiles (the legend's xb); for quantized W in the column order its chunks are converted in
  // (tile_chunks.h), over int4's padded Kp columns
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t Kx = int4 ? w.size(1) * 2 : K;  // x's columns as the tiles read them
  const std::vector<int32_t> xb =
      int8 ? tile_chunks::ordered_tile_columns(x32, M, K / 2, K / 2, [](int byte) { return byte; })
      : int4 ? tile_chunks::ordered_tile_columns(x32, M, K / 2, Kx / 2, int4::block_column)
             : tile_columns(x32, M, K / 2);
  const float* sc = int8 ? scale->data_ptr<float>() : nullptr;
  const float* b = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  auto* out = y.data_ptr<at::BFloat16>();
  if (int4) {
    const int64_t Kp = w.size(1) * 2, groups = Kp / int4::kGroup;
    const uint8_t* packed = w.data_ptr<uint8_t>();
    const at::Half *wscale = scale->data_ptr<at::Half>(), *wlow = low->data_ptr<at::Half>();
    product(xb, M, N, Kx, nullptr, b, out, [&](int64_t n0, const auto& run) {
      alignas(64) at::BFloat16 converted[4 * kNB * kStep];
      thread_local std::vector<float> params;  // the block's scales, then its lows, as float32
      const int64_t live = std::min(kNB, N - n0);
      params.resize(2 * kNB * groups);
      float *sc = params.data(), *lo = sc + kNB * groups;
      for (int64_t r = 0; r < live; ++r)
        int4::row_params(wscale + (n0 + r) * groups, wlow + (n0 + r) * groups, groups, sc + r * groups,
                         lo + r * groups);
      run(ChunkRows<Int4Chunks>{{packed + n0 * Kp / 2, sc, lo, Kp, live}, Kp / kStep, converted});
    });
  } else if (int8) {
    const int8_t* wv = w.data_ptr<int8_t>();
    static const tile_chunks::Int8Table table;
    product(xb, M, N, K, sc, b, out, [&](int64_t n0, const auto& run) {
      alignas(64) at::BFloat16 converted[4 * kNB * kStep];
      const int8_t* next = next_block(wv, n0, kNB, N, K);
      if (n0 + kNB <= N) return run(ChunkRows<Int8Chunks>{{wv + n0 * K, K, next, table}, K / kStep, converted});
      std::vector<int8_t> copy(kNB * K, 0);  // the last block's rows past N: zeros
      std::memcpy(copy.data(), wv + n0 * K, (N - n0) * K);
      run(ChunkRows<Int8Chunks>{{copy.data(), K, nullptr, table}, K / kStep, converted});
    });
  } else {
    const at::BFloat16* wv = w.data_ptr<at::BFloat16>();
    product(xb, M, N, K, sc, b, out, [&](int64_t n0, const auto& run) {
      const at::BFloat16* next = next_block(wv, n0, kNB, N, K);
      if (n0 + kNB <= N) return run(Bf16Rows{wv + n0 * K, K, next});
      std::vector<at::BFloat16> copy(kNB * K, at::BFloat16(0.f));  // the last block's rows past N: zeros
      std::memcpy(copy.data(), wv + n0 * K, (N - n0) * K * sizeof(at::BFloat16));
      run(Bf16Rows{copy.data(), K, nullptr});
    });
  }
  return y;
}

#endif  // AMX
