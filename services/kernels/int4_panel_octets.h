// The int4 panel copy (services/kernels/int4_panels.py) as its kernels read it: int4_panel_linear.cpp (products),
// int4_panel_dequantize.cpp (W for prefill) and panel_tiled_linear.cpp (many rows). Legend: N rows, Kp columns padded
// to whole 64-column blocks, P = ceil(N / 16) panels, O = Kp / 8 column octets, G = 32.
//   packed: [P, O, 64] uint8, scale / low: [P, Kp / G, 16] float16
#pragma once

#include <torch/extension.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <cstdint>

namespace int4_panels {

// An octet's 64 bytes (16 rows x 8 columns) masked, shifted and interleaved with 0x43: four registers of bf16 words
// 0x43qq = 128 + q in which 32-bit lane r holds row r's columns 8o + 2u and 8o + 2u + 1 (u = the register).
inline void octet_words(const uint8_t* octet, __m512i w[4]) {
  const __m512i mask = _mm512_set1_epi8(0x0F), tag = _mm512_set1_epi8(0x43);
  const __m512i v = _mm512_loadu_si512(octet);
  const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  w[0] = _mm512_unpacklo_epi8(lo, tag);
  w[1] = _mm512_unpackhi_epi8(lo, tag);
  w[2] = _mm512_unpacklo_epi8(hi, tag);
  w[3] = _mm512_unpackhi_epi8(hi, tag);
}

// Group g of panel p dequantized as 16 registers of bf16 pairs: lane r of pairs[4 o + u] holds row r's columns
// 32 g + 8 o + 2 u and + 1, each fma(q, scale, low) in float32 rounded to nearest even (int4_dequantize.cpp's bf16
// values, exactly) — column pair 16 g + 4 o + u of the panel in bf16_panel_dots.h's layout.
inline void group_pairs(const uint8_t* packed, const at::Half* scale, const at::Half* low, int64_t p, int64_t g,
                        int64_t Kp, __m512i pairs[16]) {
  const int64_t groups = Kp / 32, octets = Kp / 8, at = (p * groups + g) * 16;
  const __m512i high_word = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // cvtne2ps_pbh(odd, even) gives [even 0..15, odd 0..15]; this puts each lane's pair back together
  const __m512i together = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                            6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 bias = _mm512_set1_ps(128.f);
  const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at)));
  const __m512 lw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + at)));
  for (int o = 0; o < 4; ++o) {
    __m512i w[4];
    octet_words(packed + (p * octets + 4 * g + o) * 64, w);
    for (int u = 0; u < 4; ++u) {  // 128 + q as floats, exactly: the low word shifted up, the high one masked
      const __m512 even = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w[u], 16)), bias);
      const __m512 odd = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_and_si512(w[u], high_word)), bias);
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(odd, sc, lw), _mm512_fmadd_ps(even, sc, lw));
      pairs[4 * o + u] = _mm512_permutexvar_epi16(together, (__m512i)both);
    }
  }
}

// Refuses a copy that is not N rows x Kp columns in the layout above.
inline void check_copy(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low, int64_t N,
                       int64_t Kp) {
  const int64_t P = (N + 15) / 16;
  TORCH_CHECK(N > 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu() &&
                  packed.numel() == P * Kp * 8,
              "packed must be a contiguous CPU uint8 [ceil(N / 16), Kp / 8, 64] for the K given");
  for (const auto* t : {&scale, &low})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->device().is_cpu() &&
                    t->numel() == P * Kp / 32 * 16,
                "scale and low must be contiguous CPU float16 [ceil(N / 16), Kp / 32, 16]");
}

}  // namespace int4_panels

#endif
