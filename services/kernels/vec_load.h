// Loading weights and cached keys/values of any serving dtype as float32, shared by the kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

inline float scalar_to_float(float v) { return v; }
inline float scalar_to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float scalar_to_float(at::Half v) { return static_cast<float>(v); }
inline float scalar_to_float(int8_t v) { return static_cast<float>(v); }

// bf16 x for int8 W (skinny_linear.cpp), rearranged per 64 elements into the order in which int8
// W bytes come out of byte unpacking (element 16L + i, for 128-bit lane L, at 8L + i for i < 8,
// else at 32 + 8L + i - 8), so W converted to bf16 pairs with x without being shuffled back.
// Elements past the last whole 64 stay in place.
struct PairedBf16 {
  uint16_t bits;
};
inline float scalar_to_float(PairedBf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#if defined(__AVX512F__)
// 16 consecutive elements as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 is the top half of a float32
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const PairedBf16* p) {  // as bf16 (only the int8 path reads these, pairwise)
  return load16(reinterpret_cast<const at::BFloat16*>(p));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif
