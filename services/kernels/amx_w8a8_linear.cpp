// w8a8 for batches on CPUs with AMX: w8a8_linear.cpp's definition bit for bit — each row of x rounded to int8 with
// its own scale (row_rounding.h), the int8 products exact in int32, both scales applied as w8a8_linear applies them —
// with the products on the tile unit (tdpbssd: 16 x 16 x 64 multiply-adds an instruction, W's rows as they lie).
//
// Legend: M rows of x, K input features (a multiple of 64), N output features, S = K / 64 steps, Mt = ceil(M / 16)
// tiles of x, NB = 32 W rows a block (two A tiles).
//   x:     [M, K]          float32 / bf16 / fp16  -> xq [M, K] int8 and xs [M] (row_rounding.h)
//   w:     [N, K]          int8 in [-127, 127]; scale [N] float32; bias [N] x's dtype or none
//   xb:    [S, Mt, 16, 16] int32: step s, tile t, row r, lane m: xq[16t + m, 64s + 4r .. 64s + 4r + 3] (B operand)
//   A:     [16, 64]        int8 per tile: 16 W rows x one step's columns, loaded where they lie (rows K bytes apart)
//   C:     [16, 16]        int32 per (A tile a, B tile b): W rows x rows of x; tiles 0-3 (2a + b), A 4-5, B 6-7
//   y:     [M, N]          x's dtype: w8a8_value(dot, xs[m], scale[n], bias[n]) 16 lanes at a time (store)
//
// Why: on an Intel Xeon with AMX (family 6 model 207, 2 threads), 32 rows of 16384 x 2048: torch._int_mm (oneDNN's
// AMX-int8, w8a8's `int8.dynamic`) 4.2 ms, this product's sums 3.6 ms, from memory.
#pragma GCC optimize("fp-contract=off")  // float(dot) * xs * scale, then + bias: w8a8_linear's roundings

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "int8_product_args.h"
#include "rows_ahead.h"
#include "thread_chunks.h"
#include "tile_state.h"
#include "transpose16.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "row_rounding.h"

namespace {

constexpr int64_t kNB = 32, kStep = 64, kAhead = 4;

// sums [4][16][16] int32 of a block's 32 W rows (w, rows K bytes apart) against x tiles t0 and (if two) t0 + 1;
// next: the next block's first row, nullptr where none (rows_ahead.h)
void pass(const int8_t* w, const int8_t* next, int64_t K, const int32_t* xb, int64_t Mt, int64_t t0, bool two,
          int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < K / kStep; ++s) {
    const int8_t* at = w + s * kStep;
    if (const int8_t* ahead = rows_ahead(w, next, s, kAhead, K / kStep, kStep))
      for (int64_t r = 0; r < kNB; ++r) __builtin_prefetch(ahead + r * K, 0, 3);
    _tile_loadd(4, at, K);
    _tile_loadd(5, at + 16 * K, K);
    const int32_t* b = xb + (s * Mt + t0) * 256;
    _tile_loadd(6, b, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(2, 5, 6);
    if (two) {
      _tile_loadd(7, b + 256, 64);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
  _tile_stored(2, sums + 512, 64);
  _tile_stored(3, sums + 768, 64);
}

// 16 float32 rounded to y's 16-bit dtype as c10's conversions round each (w8a8_value): bf16 to nearest even with NaN
// as 0x7FC0 (c10's round_to_nearest_even, in integer lanes); fp16 by F16C's conversion to nearest (c10::Half's on x86)
inline __m256i rounded(__m512 v, const at::BFloat16*) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}
inline __m256i rounded(__m512 v, const at::Half*) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT); }
inline __m512 widened(__m256i h, const at::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widened(__m256i h, const at::Half*) { return _mm512_cvtph_ps(h); }

// y's rows 16t + m (< M), columns n0 .. n0 + 15 (< N): a sums tile [16 W rows, 16 x rows] transposed, then
// w8a8_value's float32 operations in its order and its roundings, 16 columns at a time
template <typename T>
void store(const int32_t* tile, int64_t t, int64_t M, int64_t n0, int64_t N, const float* xs, const float* scale,
           const T* bias, T* y) {
  __m512i in[16], out[16];
  for (int i = 0; i < 16; ++i) in[i] = _mm512_loadu_si512(tile + 16 * i);
  transpose16(in, out);
  const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n0)) - 1);
  const __m512 sc = _mm512_maskz_loadu_ps(lanes, scale + n0);
  for (int64_t m = 0; m < 16 && 16 * t + m < M; ++m) {
    const int64_t row = 16 * t + m;
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(out[m]), _mm512_set1_ps(xs[row])), sc);
    if constexpr (std::is_same_v<T, float>) {
      const __m512 out_v = bias ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias + n0)) : v;
      _mm512_mask_storeu_ps(y + row * N + n0, lanes, out_v);
    } else {  // rounded, then + bias rounded again (torch adds the bias after the product's rounding)
      __m256i r = rounded(v, y);
      if (bias) r = rounded(_mm512_add_ps(widened(r, y), widened(_mm256_maskz_loadu_epi16(lanes, bias + n0), y)), y);
      _mm256_mask_storeu_epi16(y + row * N + n0, lanes, r);
    }
  }
}

template <typename T>
void product(const T* x, const int8_t* w, const float* scale, const T* bias, int64_t M, int64_t N, int64_t K, T* y) {
  const RoundedX r = round_rows(x, M, K, kStep);
  const std::vector<int32_t> xb = tile_columns(reinterpret_cast<const int32_t*>(r.q.data()), M, K / 4);  // quads
  const int64_t Mt = (M + 15) / 16, blocks = (N + kNB - 1) / kNB;
  parallel_chunks(blocks, [&](int64_t b0, int64_t b1) {
    tile_state::Config config;
    for (int t = 0; t < 8; ++t) config.tile(t, 16, 64);
    config.load();
    alignas(64) int32_t sums[4 * 256];
    std::vector<int8_t> last;  // the last block's rows, zeros past N
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kNB;
      const int8_t* rows = w + n0 * K;
      const int8_t* next = next_block(w, n0, kNB, N, K);
      if (n0 + kNB > N) {
        last.assign(kNB * K, 0);
        std::memcpy(last.data(), rows, (N - n0) * K);
        rows = last.data();
      }
      for (int64_t t0 = 0; t0 < Mt; t0 += 2) {
        const bool two = t0 + 1 < Mt;
        pass(rows, next, K, xb.data(), Mt, t0, two, sums);
        for (int64_t a = 0; a < 2 && n0 + 16 * a < N; ++a)
          for (int64_t b = 0; b < (two ? 2 : 1); ++b)
            store(sums + (2 * a + b) * 256, t0 + b, M, n0 + 16 * a, N, r.s.data(), scale, bias, y);
      }
    }
    _tile_release();
  });
}

}  // namespace

// See the file's legend.
torch::Tensor amx_w8a8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(tile_state::granted(), "this process was not granted the CPU's tile state (AMX)");
  const Int8ProductArgs a = int8_product_args(x, w, scale, bias);
  TORCH_CHECK(a.K > 0 && a.K % kStep == 0, "K must be a positive multiple of 64");
  if (a.M == 0 || a.N == 0) return a.y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.x.scalar_type(), "amx_w8a8_linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
    } else {
      product<scalar_t>(a.x.data_ptr<scalar_t>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
                        a.bias.defined() ? a.bias.data_ptr<scalar_t>() : nullptr, a.M, a.N, a.K,
                        a.y.data_ptr<scalar_t>());
    }
  });
  return a.y;
}

#endif  // AMX-INT8
