// Loading weights and cached keys/values of any serving dtype as float32, shared by the kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

inline float scalar_to_float(float v) { return v; }
inline float scalar_to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float scalar_to_float(at::Half v) { return static_cast<float>(v); }
inline float scalar_to_float(int8_t v) { return static_cast<float>(v); }

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
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif
