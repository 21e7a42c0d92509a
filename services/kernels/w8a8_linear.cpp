// w8a8 on CPUs with AVX512-VNNI or AVX2: each row of x rounded to int8 with its own scale, times int8 W, the products
// exact in int32, then both scales applied — bit for bit linear_candidates._int8_dynamic_mm, torch's operators for
// the same definition, so the plan may pick either for any row count and a request's answer never depends on it.
//
// Legend: M rows of x, N rows of W (output features), K columns; x [M, K] float32 / bf16 / fp16, w [N, K] int8 in
// [-127, 127], scale [N] float32, bias [N] in x's dtype or None, y [M, N] in x's dtype. Per row m of x:
// xs[m] = max(max_k |x[m, k]|, 1e-30) / 127 (float32), xq[m, k] = round(x[m, k] / xs[m]) (halves to even),
// dot[m, n] = sum_k xq[m, k] w[n, k] (int32, exact), y[m, n] = dtype(float(dot) * xs[m] * scale[n]), then
// y + bias rounded to the dtype again (torch adds the bias after the rounding). kStep = the columns of one vector
// step, Kp = K rounded up to kStep (xq is zero there), MR = 4 rows of x and NR W rows (4 with AVX-512, 2 with AVX2)
// per register tile, kBlock = 32 W rows (64-256 KB of the `1b` shapes: L2) swept by every tile of x in turn.
//
// Why: torch's int8 x int8 product (`torch._int_mm`) runs 136 multiply-accumulates per ns at 32 and 1,024 rows on an
// AMD EPYC Zen 4 against the ~445 its vpdpbusd can do, and reads W at half the weight-only int8 kernel's rate for
// one row; on AVX2 CPUs it is a reference loop (Zen 3: ~11 s for 1,024 rows of 16384 x 2048). For one row of x
// (a decode step's batch of 1) W is only streamed: the 4-row tiles read 2048-wide W at ~30 GB/s on an AMD EPYC Zen 4
// (2 threads, weights cycled from memory) where W read row by row, as one or four parts (row_product), reads ~33 as
// int8's weight-only kernels do (16384 x 2048: 1.13 against 1.00-1.09 ms); 8192-wide W the tiles still read faster.
#pragma GCC optimize("fp-contract=off")  // y * scale + bias: two roundings, as torch's operators

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "thread_chunks.h"
#include "vec_load.h"

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

#include "int8_dot_tiles.h"  // tile, kMR, kNR, kStep, kOffset
#include "row_rounding.h"  // RoundedX, round_rows
#include "w8a8_x_panels.h"  // panel_product (AVX512-VNNI)
#include "x16_groups.h"  // kPrefetchBytes, with_prefetch_locality (the row route, AVX512-VNNI)

namespace {

constexpr int64_t kBlock = 32;

// Every tile of x against W rows [n0, n1) (one block), y's outputs stored as they come.
template <int MR, typename T>
void block_tile(const RoundedX& x, int64_t m0, const int8_t* w, int64_t n0, int64_t n1, int64_t K, const float* scale,
                const T* bias, T* y, int64_t N) {
  alignas(64) int32_t dots[16];
  for (int64_t j0 = n0; j0 < n1; j0 += kNR) {
    const int8_t* rows[kNR];
    const int64_t live = std::min(kNR, n1 - j0);
    for (int j = 0; j < kNR; ++j) rows[j] = w + std::min(j0 + j, n1 - 1) * K;  // past n1: a live row again, unused
    tile<MR>(x.q.data() + m0 * x.Kp, x.Kp, rows, K, m0 == 0, dots);
    for (int i = 0; i < MR; ++i)
      for (int64_t j = 0; j < live; ++j)
        w8a8_value(dots[kNR * i + j] - kOffset * x.sum[m0 + i], x.s[m0 + i], scale[j0 + j],
                   bias ? bias + j0 + j : nullptr, y + (m0 + i) * N + j0 + j);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// dots[r] = xq . W row r + kOffset * sum(xq), exact in int32, for R W rows `apart` rows from one to the next, read
// together; each row's bytes prefetched x16_groups.h's kPrefetchBytes / R ahead (into the rows after it in its stream),
// into the caches or past them (Locality 0), as the x16 kernels read W. Four accumulators in all hide vpdpbusd's
// latency.
template <int R, int Locality>
inline void row_dots(const int8_t* xq, const int8_t* w, int64_t K, int64_t apart, int32_t dots[R]) {
  constexpr int kPhases = 4 / R;  // accumulators per W row, over interleaved steps of K
  __m512i acc[R][kPhases];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < kPhases; ++p) acc[r][p] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // W's bytes as unsigned, as the tiles read them
  int64_t k = 0;
  for (; k + kPhases * kStep <= K; k += kPhases * kStep)
#pragma GCC unroll 4
    for (int p = 0; p < kPhases; ++p) {
      const __m512i xv = _mm512_loadu_si512(xq + k + p * kStep);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* at = w + r * apart * K + k + p * kStep;
        __builtin_prefetch(at + kPrefetchBytes / R, 0, Locality);
        dpbusd(acc[r][p], _mm512_xor_si512(_mm512_loadu_si512(at), flip), xv);
      }
    }
  for (; k < K; k += kStep) {  // the last steps, W masked past K (xq is zero there)
    const __mmask64 live = K - k >= kStep ? ~__mmask64{0} : (__mmask64{1} << (K - k)) - 1;
    const __m512i xv = _mm512_loadu_si512(xq + k);
    for (int r = 0; r < R; ++r)
      dpbusd(acc[r][0], _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, w + r * apart * K + k), flip), xv);
  }
  for (int r = 0; r < R; ++r) {
    __m512i sum = acc[r][0];
    for (int p = 1; p < kPhases; ++p) sum = _mm512_add_epi32(sum, acc[r][p]);
    dots[r] = _mm512_reduce_add_epi32(sum);
  }
}

// Each row of x against every W row, one after another: the threads take W's rows in chunks (thread_chunks.h), each
// chunk read as R parts, a row of each together (more of W in flight where the product waits on memory).
template <int R, int Locality, typename T>
void row_product(const RoundedX& x, int64_t M, const int8_t* w, int64_t N, int64_t K, const float* scale,
                 const T* bias, T* y) {
  parallel_chunks(N, [&](int64_t n0, int64_t n1) {
    const int64_t per = (n1 - n0) / R;  // W rows of each part; the rest after them, in order
    int32_t dots[R];
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xq = x.q.data() + m * x.Kp;
      const auto store = [&](int64_t n, int32_t dot) {
        w8a8_value(dot - kOffset * x.sum[m], x.s[m], scale[n], bias ? bias + n : nullptr, y + m * N + n);
      };
      for (int64_t i = 0; i < per; ++i) {
        row_dots<R, Locality>(xq, w + (n0 + i) * K, K, per, dots);
        for (int r = 0; r < R; ++r) store(n0 + r * per + i, dots[r]);
      }
      for (int64_t n = n0 + R * per; n < n1; ++n) {
        row_dots<1, Locality>(xq, w + n * K, K, 0, dots);
        store(n, dots[0]);
      }
    }
  });
}
#endif

// Which register tiles multiply: the 4 x NR tiles, w8a8_x_panels.h's panels, or (one row of x) W streamed row by row
// as `streams` parts (1, 2 or 4), prefetched past the caches or into them (the last two: AVX512-VNNI builds).
struct Route {
  enum class Kind { kTiles, kPanels, kRows } kind = Kind::kTiles;
  int64_t streams = 1;
  bool non_temporal = false;
};

template <typename T>
void product(const T* x, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* scale, const T* bias, T* y,
             Route route) {
  const RoundedX rounded = round_rows(x, M, K, kStep);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (route.kind == Route::Kind::kPanels) return panel_product(rounded, M, w, N, K, scale, bias, y);
  if (route.kind == Route::Kind::kRows) {
    const auto rows = [&](auto parts) {
      with_prefetch_locality(route.non_temporal, [&](auto locality) {
        row_product<decltype(parts)::value, decltype(locality)::value>(rounded, M, w, N, K, scale, bias, y);
      });
    };
    if (route.streams == 4) return rows(std::integral_constant<int, 4>{});
    if (route.streams == 2) return rows(std::integral_constant<int, 2>{});
    return rows(std::integral_constant<int, 1>{});
  }
#endif
  parallel_chunks((N + kBlock - 1) / kBlock, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, n1 = std::min(N, n0 + kBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kMR) switch (std::min(kMR, M - m0)) {
          case 1: block_tile<1>(rounded, m0, w, n0, n1, K, scale, bias, y, N); break;
          case 2: block_tile<2>(rounded, m0, w, n0, n1, K, scale, bias, y, N); break;
          case 3: block_tile<3>(rounded, m0, w, n0, n1, K, scale, bias, y, N); break;
          default: block_tile<4>(rounded, m0, w, n0, n1, K, scale, bias, y, N);
        }
    }
  });
}

}  // namespace

// The legend's y = x_q @ (w * scale)^T (+ bias), in x's dtype, by the route's tiles. The same result bit for bit
// whichever; which is faster depends on the shape (and the CPU), so the plan times them.
static torch::Tensor w8a8_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                  const c10::optional<torch::Tensor>& bias, Route route) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "w8a8_linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && scale.scalar_type() == torch::kFloat && scale.numel() == w.size(0),
              "w8a8_linear: w int8 [N, K], scale float32 [N]");
  TORCH_CHECK(!bias || (bias->scalar_type() == x.scalar_type() && bias->numel() == w.size(0)),
              "w8a8_linear: bias [N] in x's dtype");
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scale.contiguous();
  const c10::optional<torch::Tensor> bc = bias ? c10::optional<torch::Tensor>(bias->contiguous()) : c10::nullopt;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    product(xc.data_ptr<T>(), M, K, wc.data_ptr<int8_t>(), N, sc.data_ptr<float>(), bc ? bc->data_ptr<T>() : nullptr,
            y.data_ptr<T>(), route);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "w8a8_linear: x float32, bf16 or fp16");
  }
  return y;
}

torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias) {
  return w8a8_product(x, w, scale, bias, Route{});
}

#endif  // AVX512-VNNI or AVX2 (elsewhere neither is built nor bound: bindings.cpp)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
torch::Tensor w8a8_panel_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& bias) {
  return w8a8_product(x, w, scale, bias, Route{Route::Kind::kPanels});
}

torch::Tensor w8a8_row_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal) {
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4, "w8a8_row_linear: streams must be 1, 2 or 4, got ", streams);
  return w8a8_product(x, w, scale, bias, Route{Route::Kind::kRows, streams, non_temporal});
}
#endif
