// Group-wise int4 weights times a decode batch of several rows: y = x @ W^T (+ bias), W dequantized to
// bf16 a few rows at a time into a buffer that stays in L1/L2, then multiplied as dense bf16.
//
// Legend: M rows of x (2..64: batched decode), K input features, Kp = K padded to whole 64-column
// blocks, N output features, R = kRows W rows dequantized per buffer.
//   x:      [M, K]       bfloat16 (other dtypes: W dequantized whole, then one dense product)
//   packed, scale, low:  as in int4_block.h
//   bias:   [N]          optional, x's dtype
//   y:      [M, N]       x's dtype, accumulated in float32
//
// Why: the streaming kernel (int4_linear.cpp) turns nibbles into bf16 and applies each group's scale
// per x row, which costs twice a dense product's arithmetic per row; with 32 rows that, not memory,
// is the limit, and bf16 F.linear won (measured: 16384 x 2048, 32 rows). Here each W row is
// dequantized once per call and each product is one vdpbf16ps per 32 weights per row, in 4 x 4
// register tiles (4 x rows by 4 W rows, 16 accumulators): 8 loads per 16 dot products.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "int4_block.h"
#include "tile_chunks.h"  // int4_chunk, unpacked_byte (AVX512-VBMI builds)

namespace {

using namespace int4;
constexpr int64_t kRows = 16, kTileM = 4, kTileN = 4;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// y[m, r] for the 4 x 4 tile: x rows (bf16, [*, Kp]) and W rows (dequantized bf16, [*, Kp]); rows past
// the matrix edge point at row 0 of the tile and their results are not written.
void tile(const at::BFloat16* const* x, const at::BFloat16* const* w, int64_t Kp, float out[kTileM][kTileN]) {
  __m512 acc[kTileM][kTileN];
  for (int m = 0; m < kTileM; ++m)
    for (int r = 0; r < kTileN; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 32) {
    __m512bh wv[kTileN];
    for (int r = 0; r < kTileN; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + k);
    for (int m = 0; m < kTileM; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[m] + k);
      for (int r = 0; r < kTileN; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < kTileM; ++m)
    for (int r = 0; r < kTileN; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

// A W row's blocks (q: its nibbles), dequantized into buf [Kp]: on AVX512-VBMI builds by byte lookups, each 64-column
// block in their order (tile_chunks.h: position p holds column block_column(unpacked_byte(p))), x's columns put in
// the same order (ordered_x); elsewhere by word lookups in column order (block_bf16). The same values; a dot along K
// is the same sum up to float32's order.
inline void dequantized_row(const uint8_t* q, int64_t Kp, const float* sc, const float* lw, at::BFloat16* buf) {
  for (int64_t b = 0; b < Kp / kBlock; ++b) {
#if defined(__AVX512VBMI__)
    tile_chunks::int4_chunk(q, b, sc, lw, buf + b * kBlock, buf + b * kBlock + kBlock / 2);
#else
    block_bf16(q, b, sc, lw, buf + b * kBlock);
#endif
  }
}

// x [M, Kp] (zeros past K) with each block's columns in dequantized_row's order (permuted in place, a block at a time)
inline torch::Tensor ordered_x(const torch::Tensor& x, int64_t Kp) {
  torch::Tensor xp = padded_x(x, Kp);
#if defined(__AVX512VBMI__)
  alignas(64) uint16_t column[kBlock];  // position p's column: a word of the block's two registers
  for (int p = 0; p < kBlock; ++p) column[p] = static_cast<uint16_t>(block_column(tile_chunks::unpacked_byte(p)));
  const __m512i first = _mm512_load_si512(column), second = _mm512_load_si512(column + kBlock / 2);
  at::BFloat16* block = xp.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < xp.numel(); i += kBlock) {
    const __m512i a = _mm512_loadu_si512(block + i), b = _mm512_loadu_si512(block + i + kBlock / 2);
    _mm512_storeu_si512(block + i, _mm512_permutex2var_epi16(a, first, b));
    _mm512_storeu_si512(block + i + kBlock / 2, _mm512_permutex2var_epi16(a, second, b));
  }
#endif
  return xp;
}
#endif

}  // namespace

torch::Tensor int4_tiled_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                                const torch::Tensor& low, const c10::optional<torch::Tensor>& bias) {
  const Int4Args w = check_product(x, packed, scale, low);
  const int64_t M = x.size(0), K = x.size(1), N = w.N, Kp = w.Kp, groups = w.groups;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) {
    torch::Tensor xp = ordered_x(x, Kp);  // [M, Kp]
    const at::BFloat16* xv = xp.data_ptr<at::BFloat16>();
    torch::Tensor y32 = torch::empty({M, N}, x.options().dtype(at::kFloat));
    float* y = y32.data_ptr<float>();
    const uint8_t* q = packed.data_ptr<uint8_t>();
    const at::Half* s = scale.data_ptr<at::Half>();
    const at::Half* lo = low.data_ptr<at::Half>();
    at::parallel_for(0, (N + kRows - 1) / kRows, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> sc(groups), lw(groups);
      std::vector<at::BFloat16> buffer(kRows * Kp);  // [R, Kp]: this chunk of W, dequantized (dequantized_row)
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n0 = c * kRows, rows = std::min(kRows, N - n0);
        for (int64_t r = 0; r < rows; ++r) {
          row_params(s + (n0 + r) * groups, lo + (n0 + r) * groups, groups, sc.data(), lw.data());
          dequantized_row(q + (n0 + r) * Kp / 2, Kp, sc.data(), lw.data(), buffer.data() + r * Kp);
        }
        for (int64_t m0 = 0; m0 < M; m0 += kTileM)
          for (int64_t r0 = 0; r0 < rows; r0 += kTileN) {
            const at::BFloat16* xs[kTileM];
            const at::BFloat16* ws[kTileN];
            for (int i = 0; i < kTileM; ++i) xs[i] = xv + (m0 + i < M ? m0 + i : m0) * Kp;
            for (int i = 0; i < kTileN; ++i) ws[i] = buffer.data() + (r0 + i < rows ? r0 + i : r0) * Kp;
            float out[kTileM][kTileN];
            tile(xs, ws, Kp, out);
            for (int64_t i = 0; i < kTileM && m0 + i < M; ++i)
              for (int64_t j = 0; j < kTileN && r0 + j < rows; ++j) y[(m0 + i) * N + n0 + r0 + j] = out[i][j];
          }
      }
    });
    if (bias.has_value()) y32.add_(bias->to(at::kFloat));
    return y32.to(x.scalar_type());
  }
#endif
  // Elsewhere: the whole of W dequantized in x's dtype, then torch's dense product.
  torch::Tensor dense = torch::empty({N, K}, x.options());
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> sc(groups), lw(groups), row(Kp);
    row_params(scale.data_ptr<at::Half>() + n * groups, low.data_ptr<at::Half>() + n * groups, groups, sc.data(),
               lw.data());
    dequantize_row(packed.data_ptr<uint8_t>() + n * Kp / 2, sc.data(), lw.data(), Kp, row.data());
    dense[n].copy_(torch::from_blob(row.data(), {K}, torch::kFloat));
  }
  return torch::linear(x, dense, bias.has_value() ? *bias : torch::Tensor());
}
