// Skinny matrix products for decode: y = x @ W^T (+ bias) with few rows of x, streaming W once.
//
// Legend: M rows of x (1..a few; decode batch), K input features, N output features.
//   x:     [M, K]  float32 / bfloat16 / float16 (converted to float32 once, it is small, except
//                  bf16 x with bf16 W on CPUs with AVX512-BF16: pairs multiplied by vdpbf16ps,
//                  exact products summed in float32, twice the arithmetic rate of converting)
//   w:     [N, K]  float32 / bfloat16 / float16, or int8 with scale [N] float32 (per output row,
//                  symmetric: w_real[n, k] = w[n, k] * scale[n])
//   bias:  [N]     optional, x's dtype
//   y:     [M, N]  x's dtype, accumulated in float32 and rounded once (as torch's CPU linear does)
//
// Why: a decode step is a chain of these products, and all it does is read W. torch's CPU paths
// stream 16-bit weights at half the read bandwidth on some hosts (see issue "decode at the
// bandwidth limit"); this loop converts each W element in registers, reads each chunk of rows as one
// sequential stream, and keeps four accumulators in flight, so the only limit is how fast memory
// delivers W. Threads take N's rows in chunks (thread_chunks.h). The float32 loop is written once over
// FloatVec (vec_load.h): 16 lanes with AVX-512, 8 with AVX2 (an AVX2-only Zen 3: bf16 W at 28.6 GB/s
// against torch's 20, see docs/kernels.md).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <type_traits>

#include "skinny_rows.h"
#include "thread_chunks.h"
#include "vec_load.h"

namespace {

using skinny_rows::dot_rows, skinny_rows::kAcc, skinny_rows::kMaxTileM;


template <typename X, typename W, int MT, int R, int Locality>
void tile(const X* x, int64_t K, const W* w, int64_t n_begin, int64_t n_end, bool parts, const float* scale,
          float* y, int64_t N) {
  // x: [MT, K]; y: [MT, N] float32 (this tile's rows of the output)
  float acc[kMaxTileM][kAcc];
  auto rows = [&](int64_t n, int64_t apart) {  // W rows n + r * apart for r < R
    dot_rows<X, W, MT, R, Locality>(x, K, w + n * K, K, apart * K, apart == 1 ? R * K : K, acc);
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R; ++r) y[m * N + n + r * apart] = acc[m][r] * (scale ? scale[n + r * apart] : 1.f);
  };
  int64_t n = n_begin;
  if (parts && R > 1) {  // row i of each quarter together
    const int64_t per = (n_end - n_begin) / R;
    for (int64_t i = 0; i < per; ++i) rows(n_begin + i, per);
    n += R * per;
  }
  for (; n + R <= n_end; n += R) rows(n, 1);
  for (; n < n_end; ++n) {  // the last rows when R does not divide the range
    dot_rows<X, W, MT, 1, Locality>(x, K, w + n * K, K, K, K, acc);
    for (int m = 0; m < MT; ++m) y[m * N + n] = acc[m][0] * (scale ? scale[n] : 1.f);
  }
}

template <typename X, typename W, int R, int Locality>
void run_tile(int64_t mt, const X* x, int64_t K, const W* w, int64_t n0, int64_t n1, bool parts, const float* scale,
              float* y, int64_t N) {
  switch (mt) {
    case 1: tile<X, W, 1, R, Locality>(x, K, w, n0, n1, parts, scale, y, N); break;
    case 2: tile<X, W, 2, R, Locality>(x, K, w, n0, n1, parts, scale, y, N); break;
    case 3: tile<X, W, 3, R, Locality>(x, K, w, n0, n1, parts, scale, y, N); break;
    default: tile<X, W, 4, R, Locality>(x, K, w, n0, n1, parts, scale, y, N); break;
  }
}

// finish(n0, n1): called by a thread once a chunk's rows n0 .. n1 - 1 of y (every x row) are summed, while they are
// still in its cache (skinny_linear rounds them into the output there).
template <typename X, typename W>
void skinny(const X* x, int64_t M, int64_t K, const W* w, int64_t N, const float* scale, float* y, int64_t rows,
            bool non_temporal, bool parts, const std::function<void(int64_t, int64_t)>& finish) {
  // W's rows in chunks of whole groups of `rows` that the threads take in turn (thread_chunks.h): each chunk a
  // contiguous stream, read once for every tile of x rows (with M <= 4 exactly once).
  const int64_t groups = (N + rows - 1) / rows;
  parallel_chunks(groups, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * rows, n1 = std::min(N, g1 * rows);
    for (int64_t m = 0; m < M; m += kMaxTileM) {
      const int64_t mt = std::min(kMaxTileM, M - m);
      const X* xm = x + m * K;
      if (rows == kAcc && non_temporal) run_tile<X, W, kAcc, 0>(mt, xm, K, w, n0, n1, parts, scale, y + m * N, N);
      else if (rows == kAcc) run_tile<X, W, kAcc, 3>(mt, xm, K, w, n0, n1, parts, scale, y + m * N, N);
      else run_tile<X, W, 1, 3>(mt, xm, K, w, n0, n1, false, scale, y + m * N, N);
    }
    finish(n0, n1);
  });
}

// y[m, n] = Out(sums[m, n] + bias[n]) for every x row m and n0 <= n < n1 (bias may be null; Out float32: in place).
template <typename Out>
void round_rows(float* sums, const float* bias, Out* y, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  if (std::is_same_v<Out, float> && bias == nullptr) return;  // y is the sums
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * N + n] = static_cast<Out>(bias ? sums[m * N + n] + bias[n] : sums[m * N + n]);
}

}  // namespace

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                            const c10::optional<torch::Tensor>& bias, int64_t rows, bool non_temporal, bool parts) {
  TORCH_CHECK(rows == 1 || rows == kAcc, "rows in flight must be 1 or ", kAcc);
  TORCH_CHECK(!non_temporal || rows == kAcc, "non_temporal names the prefetch of ", kAcc, " rows in flight");
  TORCH_CHECK(!parts || rows == kAcc, "parts names ", kAcc, " rows in flight, one from each quarter");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool quantized = w.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == scale.has_value(), "a scale goes with int8 weights, and only with them");
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "bias must have one entry per output row");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16, not ", x.scalar_type());
  torch::Tensor scale32;
  if (quantized) {
    scale32 = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(scale32.numel() == N, "scale must have one entry per output row");
  }
  const float* s = quantized ? scale32.data_ptr<float>() : nullptr;
  // y in x's dtype. The sums go to y32 (y itself for float32 x) and each thread rounds its own rows into y as it
  // finishes them, bias added first: one rounding, as torch's CPU linear rounds. y32 (and x32 below) are plain
  // buffers, not tensors: a torch operator (a conversion call, ~7 us; an allocation) has its code and data fetched
  // from memory anew after a decode product has streamed its weight through the caches, ~65 times a `1b` step.
  torch::Tensor y = torch::empty({M, N}, x.options());
  std::unique_ptr<float[]> y32(x.scalar_type() == at::kFloat ? nullptr : new float[M * N]);  // not zeroed
  const torch::Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  float* yf = x.scalar_type() == at::kFloat ? y.data_ptr<float>() : y32.get();
  const float* bv = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  const std::function<void(int64_t, int64_t)> finish = [&](int64_t n0, int64_t n1) {
    switch (y.scalar_type()) {
      case at::kFloat: round_rows(yf, bv, y.data_ptr<float>(), M, N, n0, n1); break;
      case at::kBFloat16: round_rows(yf, bv, y.data_ptr<at::BFloat16>(), M, N, n0, n1); break;
      default: round_rows(yf, bv, y.data_ptr<at::Half>(), M, N, n0, n1); break;
    }
  };
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  if (x.scalar_type() == at::kBFloat16 && quantized) {
    const torch::Tensor xc = x.contiguous();
    const at::BFloat16* xv = xc.data_ptr<at::BFloat16>();
    // x rearranged as PairedBf16 orders it (paired_index): in each whole 64, the 8 elements 16L + 8h .. + 7 move
    // together to 32h + 8L; the rest stays in place. 16 bytes a copy: this runs before every int8 decode product.
    std::vector<PairedBf16> paired(M * K);
    const int64_t K64 = K / 64 * 64;
    for (int64_t m = 0; m < M; ++m) {
      const at::BFloat16* from = xv + m * K;
      PairedBf16* to = paired.data() + m * K;
      for (int64_t c = 0; c < K64; c += 64)
        for (int lane = 0; lane < 4; ++lane)
          for (int half = 0; half < 2; ++half)
            std::memcpy(to + c + 32 * half + 8 * lane, from + c + 16 * lane + 8 * half, 16);
      std::memcpy(to + K64, from + K64, 2 * (K - K64));
    }
    skinny(paired.data(), M, K, w.data_ptr<int8_t>(), N, s, yf, rows, non_temporal, parts, finish);
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    const torch::Tensor xc = x.contiguous();
    skinny(xc.data_ptr<at::BFloat16>(), M, K, w.data_ptr<at::BFloat16>(), N, s, yf, rows, non_temporal, parts, finish);
    return y;
  }
#endif
  const torch::Tensor xc = x.contiguous();
  std::vector<float> x32;  // 16-bit x as float32, once: it is small
  if (x.scalar_type() == at::kBFloat16) x32.assign(xc.data_ptr<at::BFloat16>(), xc.data_ptr<at::BFloat16>() + M * K);
  if (x.scalar_type() == at::kHalf) x32.assign(xc.data_ptr<at::Half>(), xc.data_ptr<at::Half>() + M * K);
  const float* xf = x.scalar_type() == at::kFloat ? xc.data_ptr<float>() : x32.data();
  switch (w.scalar_type()) {
    case at::kFloat: skinny(xf, M, K, w.data_ptr<float>(), N, s, yf, rows, non_temporal, parts, finish); break;
    case at::kBFloat16: skinny(xf, M, K, w.data_ptr<at::BFloat16>(), N, s, yf, rows, non_temporal, parts, finish); break;
    case at::kHalf: skinny(xf, M, K, w.data_ptr<at::Half>(), N, s, yf, rows, non_temporal, parts, finish); break;
    case at::kChar: skinny(xf, M, K, w.data_ptr<int8_t>(), N, s, yf, rows, non_temporal, parts, finish); break;
    default: TORCH_CHECK(false, "unsupported weight dtype ", w.scalar_type());
  }
  return y;
}
