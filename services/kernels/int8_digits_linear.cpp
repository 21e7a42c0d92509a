// Per-channel int8 weights (weight-only int8) times x in 21-bit fixed point, by int8 dot products: x's rows as three
// int8 digit rows each (x_digits.h), multiplied by W's int8 rows exactly in int32 by w8a8's register tiles
// (int8_dot_tiles.h), the three digit dots joined exactly in int64, then one float conversion and W's scale.
//
// Legend: M rows of x, K input features (<= 65,536: the dots stay in int32), N output features, R = 3M digit rows,
// kBlock = 32 W rows the threads take in chunks (thread_chunks.h).
//   x:     [M, K]  float32 / bf16 / fp16      -> digits q [R, Kp] int8, units u [M] (x_digits.h)
//   w:     [N, K]  int8 in [-127, 127];  scale [N] float32: w[n, k] ~= q[n, k] * scale[n];  bias [N] x's dtype or none
//   dots:  [R, kNR] int32 a thread's sums of every digit row against the kNR W rows in hand
//   y:     [M, N]  x's dtype: D = sum_k X[m, k] w[n, k] (int64, exact: digit dots joined as X's digits are),
//                  y = float(D) * u[m] * scale[n] (+ bias), rounded once to x's dtype
//
// Why: weight-only int8's product for few rows is bound by how fast W's bytes stream. On an Intel Xeon with AMX
// (family 6 model 207, 2 threads, 16 distinct 16384 x 2048 weights cycled from memory) int8_x16_linear, which widens
// W to int16 and scales every 32-column group in float32, read 26.7 GB/s and this product 30.9 (w8a8's own one-row
// product 31.9): W's vector is loaded and offset once for all the rows of x, so the digits cost little. In the int8
// `1b` decode step 40.5 ms against 45.8 with int8_x16_linear (docs/kernels.md).
#pragma GCC optimize("fp-contract=off")  // float(D) * u * scale, then + bias: each rounded as written

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "thread_chunks.h"

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

#include "int8_dot_tiles.h"  // tile, kMR, kNR, kStep, kOffset
#include "int8_product_args.h"
#include "x_digits.h"  // XDigits, digit_rows

namespace {

constexpr int64_t kBlock = 32;

// dots[r * kNR + j] for every digit row r against the kNR W rows `rows` (the first tile prefetches the next ones)
void digit_dots(const XDigits& d, int64_t R, const int8_t* const rows[kNR], int64_t K, int32_t* dots) {
  alignas(64) int32_t tile_dots[16];
  for (int64_t r0 = 0; r0 < R; r0 += kMR) {
    const int64_t mr = std::min(kMR, R - r0);
    const int8_t* q = d.q.data() + r0 * d.Kp;
    switch (mr) {
      case 1: tile<1>(q, d.Kp, rows, K, r0 == 0, tile_dots); break;
      case 2: tile<2>(q, d.Kp, rows, K, r0 == 0, tile_dots); break;
      case 3: tile<3>(q, d.Kp, rows, K, r0 == 0, tile_dots); break;
      default: tile<4>(q, d.Kp, rows, K, r0 == 0, tile_dots);
    }
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < kNR; ++j) dots[(r0 + i) * kNR + j] = tile_dots[kNR * i + j] - kOffset * d.sum[r0 + i];
  }
}

template <typename T>
void product(const T* x, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* scale, const T* bias, T* y) {
  const XDigits d = digit_rows(x, M, K, kStep);
  const int64_t R = 3 * M;
  parallel_chunks((N + kBlock - 1) / kBlock, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> dots(R * kNR);
    for (int64_t n0 = b0 * kBlock; n0 < std::min(N, b1 * kBlock); n0 += kNR) {
      const int64_t live = std::min(kNR, N - n0);
      const int8_t* rows[kNR];
      for (int64_t j = 0; j < kNR; ++j) rows[j] = w + std::min(n0 + j, N - 1) * K;  // past N: a live row, unused
      digit_dots(d, R, rows, K, dots.data());
      for (int64_t m = 0; m < M; ++m) {
        const int32_t* dm = dots.data() + 3 * m * kNR;
        for (int64_t j = 0; j < live; ++j) {
          const int64_t D = (int64_t{dm[j]} * 128 + dm[kNR + j]) * 128 + dm[2 * kNR + j];
          float v = static_cast<float>(D) * d.u[m] * scale[n0 + j];
          if (bias) v += static_cast<float>(bias[n0 + j]);
          y[m * N + n0 + j] = static_cast<T>(v);
        }
      }
    }
  });
}

}  // namespace

// See the file's legend.
torch::Tensor int8_digits_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                 const c10::optional<torch::Tensor>& bias) {
  const Int8ProductArgs a = int8_product_args(x, w, scale, bias);
  TORCH_CHECK(a.K > 0 && a.K <= 65536, "K must be 1 to 65,536 columns (the dots stay in int32)");
  if (a.M == 0 || a.N == 0) return a.y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.x.scalar_type(), "int8_digits_linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
    } else {
      product<scalar_t>(a.x.data_ptr<scalar_t>(), a.M, a.K, w.data_ptr<int8_t>(), a.N, scale.data_ptr<float>(),
                        a.bias.defined() ? a.bias.data_ptr<scalar_t>() : nullptr, a.y.data_ptr<scalar_t>());
    }
  });
  return a.y;
}

#endif  // AVX512-VNNI or AVX2
