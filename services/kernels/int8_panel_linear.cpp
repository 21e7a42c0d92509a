// Per-channel int8 weights (weight-only int8) in 16-row panels (services/kernels/int8_panels.py: a copy of the weight,
// kept where the kernel plan chose this kernel), times x in 21-bit fixed point on CPUs with AVX512-VNNI: x's rows as
// three int8 digit rows each (x_digits.h), multiplied by the panels' bytes exactly in int32, the three dots joined
// exactly in int64, then one float conversion and W's scale — int8_digits_linear.cpp's product bit for bit, from
// another layout.
//
// Legend: M rows of x, K input features (<= 65,536: the dots stay in int32), Kp = K rounded up to 64, K4 = Kp / 4
// column quads, N output features, P = ceil(N / 16) panels (the last one's missing rows zero), R = 3M digit rows.
//   x:      [M, K]       float32 / bf16 / fp16  -> digits q [R, Kp] int8, units u [M], digit sums [R] (x_digits.h)
//   panels: [P, K4, 16]  int32: lane r of entry (p, j) holds W[16p + r, 4j .. 4j + 3] + 128 as four unsigned bytes
//   scale:  [N]          float32: w[n, k] ~= W[n, k] * scale[n];  bias [N] x's dtype or none
//   y:      [M, N]       x's dtype: D = sum_k X[m, k] W[n, k] (int64, exact), y = float(D) * u[m] * scale[n] (+ bias)
//
// Why the panels: the row layout's tiles (int8_dot_tiles.h) sum each W row's dots across a vector's lanes at the end of
// every tile and read 4 rows as 4 streams; here a 64-byte entry is 16 rows' quads of one column quad, so each
// vpdpbusd takes one broadcast quad of a digit row and the 16 rows' dots stay in the lanes, one stream a panel.
#pragma GCC optimize("fp-contract=off")  // float(D) * u * scale, then + bias: each rounded as written

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "thread_chunks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

#include "x16_groups.h"  // with_prefetch_locality
#include "x_digits.h"    // XDigits, digit_rows

namespace {

constexpr int64_t kPanel = 16, kStep = 64, kOffset = 128;
constexpr int64_t kTile = 4;               // x rows (12 digit rows) per pass over a panel
constexpr int64_t kAheadBytes = 1024;      // prefetch distance in all (each of S streams: 1 / S of it)

// acc += u (unsigned bytes) . v (signed) in place (as int8_dot_tiles.h: GCC copied accumulators around the intrinsic)
inline void dpbusd(__m512i& acc, __m512i u, __m512i v) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(v)); }

// dots[(s * DR + r) * 16 + lane] = digit row r . (W row 16 (p + s * apart) + lane + 128) for S panels `apart` apart
// and DR = 3 MT digit rows (q: [DR, Kp], Kp / 4 quads each). Each row's dots run as C chains (quad j feeds chain j % C).
template <int MT, int S, int Locality>
void panel_dots(const int32_t* panels, int64_t p, int64_t apart, const int8_t* q, int64_t Kp, int32_t* dots) {
  constexpr int DR = 3 * MT, C = MT == 1 ? 2 : 1;
  static_assert(S * DR * C <= 24, "accumulators past the registers");
  const int64_t K4 = Kp / 4;
  __m512i acc[S][DR][C];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < DR; ++r)
      for (int c = 0; c < C; ++c) acc[s][r][c] = _mm512_setzero_si512();
  const int32_t* panel[S];
  for (int s = 0; s < S; ++s) panel[s] = panels + (p + s * apart) * K4 * kPanel;
  for (int64_t j0 = 0; j0 < K4; j0 += 2)  // K4 is a multiple of 16
    for (int u = 0; u < 2; ++u)
      for (int s = 0; s < S; ++s) {
        const int32_t* at = panel[s] + (j0 + u) * kPanel;
        __builtin_prefetch(reinterpret_cast<const char*>(at) + kAheadBytes / S, 0, Locality);
        const __m512i w = _mm512_loadu_si512(at);
        for (int r = 0; r < DR; ++r) {
          int32_t quad;
          std::memcpy(&quad, q + r * Kp + 4 * (j0 + u), 4);
          dpbusd(acc[s][r][u % C], w, _mm512_set1_epi32(quad));
        }
      }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < DR; ++r) {
      __m512i sum = acc[s][r][0];
      if constexpr (C == 2) sum = _mm512_add_epi32(sum, acc[s][r][1]);
      _mm512_storeu_si512(dots + (s * DR + r) * kPanel, sum);
    }
}

template <typename T>
struct Product {
  const int32_t* panels;
  const XDigits* d;
  const float* scale;
  const T* bias;  // [N] or nullptr
  int64_t M, N;
  T* y;  // [M, N]

  template <int MT, int S, int Locality>
  void panel(int64_t p, int64_t apart, int64_t m0) const {
    constexpr int DR = 3 * MT;
    alignas(64) int32_t dots[S * DR * kPanel];
    panel_dots<MT, S, Locality>(panels, p, apart, d->q.data() + 3 * m0 * d->Kp, d->Kp, dots);
    for (int s = 0; s < S; ++s) {
      const int64_t n0 = (p + s * apart) * kPanel, live = std::min(kPanel, N - n0);
      for (int m = 0; m < MT; ++m) {
        const int32_t* dm = dots + (s * DR + 3 * m) * kPanel;
        const int32_t* sums = d->sum.data() + 3 * (m0 + m);
        const float u = d->u[m0 + m];
        for (int64_t l = 0; l < live; ++l) {  // int8_digits_linear's D and float steps, in its order
          const int64_t D = (int64_t{dm[l] - kOffset * sums[0]} * 128 + (dm[kPanel + l] - kOffset * sums[1])) * 128 +
                            (dm[2 * kPanel + l] - kOffset * sums[2]);
          float v = static_cast<float>(D) * u * scale[n0 + l];
          if (bias) v += static_cast<float>(bias[n0 + l]);
          y[(m0 + m) * N + n0 + l] = static_cast<T>(v);
        }
      }
    }
  }

  // One x row: each thread's panels read as `S` parts, a panel of each together.
  template <int S, int Locality>
  void one_row(int64_t p0, int64_t p1) const {
    const int64_t per = (p1 - p0) / S;
    for (int64_t p = p0; p < p0 + per; ++p) panel<1, S, Locality>(p, per, 0);
    for (int64_t p = p0 + S * per; p < p1; ++p) panel<1, 1, Locality>(p, 0, 0);
  }

  // Several: two adjacent panels at a time against kTile rows of x a pass (later passes find them in L2).
  template <int Locality>
  void rows(int64_t p0, int64_t p1) const {
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2)
      for (int64_t m0 = 0; m0 < M; m0 += kTile) tile<2, Locality>(p, m0);
    for (; p < p1; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += kTile) tile<1, Locality>(p, m0);
  }

  template <int S, int Locality>
  void tile(int64_t p, int64_t m0) const {
    switch (std::min(kTile, M - m0)) {
      case 1: panel<1, S, Locality>(p, 1, m0); break;
      case 2: panel<2, S, Locality>(p, 1, m0); break;
      case 3: panel<3, S, Locality>(p, 1, m0); break;
      default: panel<4, S, Locality>(p, 1, m0);
    }
  }
};

}  // namespace

// See the file's legend.
torch::Tensor int8_panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a CPU [M, K]");
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4, "streams must be 1, 2 or 4, got ", streams);
  const int64_t M = x.size(0), K = x.size(1), N = scale.numel(), Kp = (K + kStep - 1) / kStep * kStep;
  TORCH_CHECK(K > 0 && K <= 65536, "K must be 1 to 65,536 columns (the dots stay in int32)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && N > 0, "scale must be a float32 [N]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kInt && panels.is_contiguous() && panels.device().is_cpu()
              && panels.size(0) == (N + kPanel - 1) / kPanel && panels.size(1) == Kp / 4 && panels.size(2) == kPanel,
              "panels must be a contiguous CPU int32 [", (N + kPanel - 1) / kPanel, ", ", Kp / 4, ", 16] for ", N,
              " x ", K, " W, got ", panels.sizes());
  const torch::Tensor xc = x.contiguous();
  torch::Tensor biasc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have N elements");
    biasc = bias->to(xc.scalar_type()).contiguous();
  }
  torch::Tensor y = torch::empty({M, N}, xc.options());
  if (M == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "int8_panel_linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
    } else {
      const XDigits d = digit_rows(xc.data_ptr<scalar_t>(), M, K, kStep);
      const Product<scalar_t> product{panels.data_ptr<int32_t>(), &d, scale.data_ptr<float>(),
                                      bias.has_value() ? biasc.data_ptr<scalar_t>() : nullptr, M, N,
                                      y.data_ptr<scalar_t>()};
      with_prefetch_locality(non_temporal, [&](auto locality) {
        constexpr int L = decltype(locality)::value;
        parallel_chunks((N + kPanel - 1) / kPanel, [&](int64_t p0, int64_t p1) {
          if (M > 1) product.template rows<L>(p0, p1);
          else if (streams == 4) product.template one_row<4, L>(p0, p1);
          else if (streams == 2) product.template one_row<2, L>(p0, p1);
          else product.template one_row<1, L>(p0, p1);
        });
        return 0;
      });
    }
  });
  return y;
}

#endif  // AVX512-VNNI
