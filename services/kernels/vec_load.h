// Loading weights and cached keys/values of any serving dtype as float32, shared by the kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 8 consecutive elements as float32 (CPUs with AVX2 but not AVX-512: Zen 1-3, Intel client cores).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// The sum of the 8 lanes (also on AVX-512 CPUs, whose FloatVec is 16 lanes wide).
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// The largest of the 8 lanes.
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

// The widest float32 vector of this CPU, for loops written once for both widths: 16 lanes with
// AVX-512, 8 with AVX2 + FMA + F16C; neither: PDSERVE_FLOAT_VEC is undefined and callers run scalar.
#if defined(__AVX512F__)
#define PDSERVE_FLOAT_VEC 1
struct FloatVec {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  template <typename T>
  static V load(const T* p) { return load16(p); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_FLOAT_VEC 1
struct FloatVec {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  template <typename T>
  static V load(const T* p) { return load8(p); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) { return sum8(v); }
};
#endif
