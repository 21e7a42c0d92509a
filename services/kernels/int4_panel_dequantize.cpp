// Group-wise int4 weights in 16-row panels (services/kernels/int4_panels.py) dequantized whole, for prefill's dense
// product over many rows: with this, a weight whose plan reads only the panel copy needs no row layout.
//
// Legend (int4_panel_linear.cpp's): N output features, K input features, Kp = K padded to whole 64-column blocks,
// G = 32, P = ceil(N / 16) panels, O = Kp / 8 column octets.
//   packed: [P, O, 64] uint8, scale / low: [P, Kp / G, 16] float16  (w[n, k] = q * scale + low of row n's group)
//   out:    [N, K] bfloat16 (int4_dequantize.cpp's layout: oneDNN's bf16 product from W^T [K, N] took 1.15x as long,
//           16384 x 2048 at 1,024 rows, AMD EPYC Zen 4)
// A group's 4 octets unpack to 16 registers whose 32-bit lane r holds panel row r's two adjacent columns, dequantized
// as pairs (int4_panel_octets.h's group_pairs) and transposed (transpose16.h) into 16 rows of 32 columns: one 64-byte
// store a row. Each value is fma(q, scale, low) in float32 rounded to nearest even: int4_dequantize.cpp's bf16
// output, exactly.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "int4_panel_octets.h"
#include "thread_chunks.h"
#include "transpose16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kPanel = 16, kGroup = 32;

// Panel p into out's rows 16p .. 16p + live - 1 (the last panel's missing rows not written).
void dequantize_panel(const uint8_t* packed, const at::Half* scale, const at::Half* low, int64_t p, int64_t K,
                      int64_t Kp, int64_t N, at::BFloat16* out) {
  const int64_t groups = Kp / kGroup, n0 = p * kPanel, live = std::min(kPanel, N - n0);
  for (int64_t g = 0; g < groups && kGroup * g < K; ++g) {
    __m512i column_pairs[16], rows[16];  // [4 o + u]: lane r = row r's columns 32g + 8o + 2u, + 1 as a bf16 pair
    int4_panels::group_pairs(packed, scale, low, p, g, Kp, column_pairs);
    transpose16(column_pairs, rows);
    const int64_t width = std::min(kGroup, K - kGroup * g);
    const __mmask32 columns = width == kGroup ? ~__mmask32(0) : static_cast<__mmask32>((1u << width) - 1);
    for (int64_t r = 0; r < live; ++r) _mm512_mask_storeu_epi16(out + (n0 + r) * K + kGroup * g, columns, rows[r]);
  }
}

}  // namespace

torch::Tensor int4_panel_dequantize(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low,
                                    int64_t N, torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.device().is_cpu() && out.scalar_type() == at::kBFloat16 &&
                  out.size(0) == N && out.size(1) > 0,
              "out must be a contiguous CPU bfloat16 [N, K]");
  const int64_t K = out.size(1), Kp = (K + 63) / 64 * 64, P = (N + kPanel - 1) / kPanel;
  int4_panels::check_copy(packed, scale, low, N, Kp);
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half *s = scale.data_ptr<at::Half>(), *lo = low.data_ptr<at::Half>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  parallel_chunks(P, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) dequantize_panel(q, s, lo, p, K, Kp, N, o);
  });
  return out;
}

#endif  // AVX512-BF16
