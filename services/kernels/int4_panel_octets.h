// The int4 panel copy (services/kernels/int4_panels.py) as its two kernels read it: int4_panel_linear.cpp (products)
// and int4_panel_dequantize.cpp (W for prefill). Legend: N rows, Kp columns padded to whole 64-column blocks,
// P = ceil(N / 16) panels, O = Kp / 8 column octets, G = 32.
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
