// Group-wise int4 weights in 16-row panels (services/kernels/int4_panels.py) dequantized whole, for prefill's dense
// product over many rows: with this, a weight whose plan reads only the panel copy needs no row layout.
//
// Legend (int4_panel_linear.cpp's): N output features, K input features, Kp = K padded to whole 64-column blocks,
// G = 32, P = ceil(N / 16) panels, O = Kp / 8 column octets.
//   packed: [P, O, 64] uint8, scale / low: [P, Kp / G, 16] float16  (w[n, k] = q * scale + low of row n's group)
//   out:    [N, K] bfloat16 (int4_dequantize.cpp's layout: oneDNN's bf16 product from W^T [K, N] took 1.15x as long,
//           16384 x 2048 at 1,024 rows, AMD EPYC Zen 4)
// An octet unpacks to registers whose 32-bit lane r holds panel row r's two adjacent columns; a group's 4 octets give
// 16 such registers (16 column pairs), dequantized as pairs and transposed (transpose16.h) into 16 rows of 32 columns:
// one 64-byte store a row. Each value is fma(q, scale, low) in float32 rounded to nearest even: int4_dequantize.cpp's
// bf16 output, exactly.

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
  const int64_t groups = Kp / kGroup, octets = Kp / 8, n0 = p * kPanel, live = std::min(kPanel, N - n0);
  const __m512i high_word = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // cvtne2ps_pbh(odd, even) gives [even 0..15, odd 0..15]; this puts each lane's pair back together
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 bias = _mm512_set1_ps(128.f);
  for (int64_t g = 0; g < groups && kGroup * g < K; ++g) {
    const int64_t at = (p * groups + g) * kPanel;
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at)));
    const __m512 lw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + at)));
    __m512i column_pairs[16], rows[16];  // [4 o + u]: lane r = row r's columns 32g + 8o + 2u, + 1 as a bf16 pair
    for (int o = 0; o < 4; ++o) {
      __m512i w[4];
      int4_panels::octet_words(packed + (p * octets + 4 * g + o) * 64, w);
      for (int u = 0; u < 4; ++u) {  // 128 + q as floats, exactly: the low word shifted up, the high one masked
        const __m512 even = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w[u], 16)), bias);
        const __m512 odd = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_and_si512(w[u], high_word)), bias);
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(odd, sc, lw), _mm512_fmadd_ps(even, sc, lw));
        column_pairs[4 * o + u] = _mm512_permutexvar_epi16(pairs, (__m512i)both);
      }
    }
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
