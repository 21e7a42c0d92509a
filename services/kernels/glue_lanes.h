// The vector lanes of decoder_glue.cpp's passes: float32 vectors loaded from and stored to a tensor's dtype, rounded
// to it as torch rounds, with short runs at a row's end; and, for the builds that have them, the native silu_mul's
// declaration (bindings.cpp and decode_chain.cpp call it), so the condition is written once.
//
// GlueLanes (kLanes float32 lanes in a V):
//   load(p, count) / store(p, v, count): count <= kLanes elements of T (lanes past count read as 0, left unwritten)
//   round_to(v, (T*) nullptr): each lane rounded to T (to nearest even, as torch converts), still float32
//   square_sum(acc, v) / total(acc): a running sum of the lanes' squares in float64 (products exact), and its total
//   silu_times<T>(g, u): silu(g) rounded to T, times u, rounded to T
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "softmax_math.h"
#include "vec_load.h"

// AVX-512 BW/VL (16 lanes, masked loads and stores) or AVX2 + FMA + F16C without AVX-512 (8 lanes: AMD Zen 1-3,
// Intel client cores); other builds run the scalar loops and torch's F.silu and mul.
#if (defined(__AVX512BW__) && defined(__AVX512VL__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__))
#define PDSERVE_GLUE_LANES

// gate_up [N, 2F] (contiguous, float32 / bfloat16 / float16) -> silu(gate) * up [N, F], gate = gate_up[:, :F].
torch::Tensor silu_mul(const torch::Tensor& gate_up);
#endif

#if defined(PDSERVE_GLUE_LANES) && defined(__AVX512F__)
struct GlueLanes {
  using V = __m512;
  using Sum = __m512d;
  static constexpr int kLanes = 16;
  static __mmask16 mask(int64_t count) { return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1); }
  static V load(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(mask(count), p); }
  static V load(const at::BFloat16* p, int64_t count) {  // bf16 is the top half of a float32
    const __m256i raw = _mm256_maskz_loadu_epi16(mask(count), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V load(const at::Half* p, int64_t count) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(count), p)); }
  static V round_to(V v, float*) { return v; }
  static V round_to(V v, at::BFloat16*) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static V round_to(V v, at::Half*) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
  static void store(float* p, V rounded, int64_t count) { _mm512_mask_storeu_ps(p, mask(count), rounded); }
  static void store(at::BFloat16* p, V rounded, int64_t count) {  // the top halves, exact
    _mm256_mask_storeu_epi16(p, mask(count), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
  }
  static void store(at::Half* p, V rounded, int64_t count) {
    _mm256_mask_storeu_epi16(p, mask(count), _mm512_cvtps_ph(rounded, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static Sum square_sum(Sum acc, V v) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm512_fmadd_pd(hi, hi, _mm512_fmadd_pd(lo, lo, acc));
  }
  static Sum no_sum() { return _mm512_setzero_pd(); }
  static double total(Sum acc) { return _mm512_reduce_add_pd(acc); }
  // silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below, e = e^-|g|
  template <typename T>
  static V silu_times(V g, V u) {
    const V one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
    const V e = exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
    const V numerator = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ), g, e);
    const V silu = round_to(_mm512_div_ps(numerator, _mm512_add_ps(one, e)), static_cast<T*>(nullptr));
    return round_to(_mm512_mul_ps(silu, u), static_cast<T*>(nullptr));
  }
};
#elif defined(PDSERVE_GLUE_LANES)
// The same on 8 lanes; a row's last < 8 elements staged through a buffer (AVX2 has no masked 16-bit loads).
struct GlueLanes {
  using V = __m256;
  using Sum = __m256d;
  static constexpr int kLanes = 8;
  template <typename T>
  static V load(const T* p, int64_t count) {
    if (count >= 8) return load8(p);
    T tail[8] = {};
    std::copy(p, p + count, tail);
    return load8(tail);
  }
  static V round_to(V v, float*) { return v; }
  static V round_to(V v, at::BFloat16*) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static V round_to(V v, at::Half*) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
  static void store8(float* p, V rounded) { _mm256_storeu_ps(p, rounded); }
  static void store8(at::BFloat16* p, V rounded) {  // the top halves (each <= 0xFFFF: the unsigned pack is exact)
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
  }
  static void store8(at::Half* p, V rounded) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(rounded, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  template <typename T>
  static void store(T* p, V rounded, int64_t count) {
    if (count >= 8) return store8(p, rounded);
    T tail[8];
    store8(tail, rounded);
    std::copy(tail, tail + count, p);
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static Sum square_sum(Sum acc, V v) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    return _mm256_fmadd_pd(hi, hi, _mm256_fmadd_pd(lo, lo, acc));
  }
  static Sum no_sum() { return _mm256_setzero_pd(); }
  static double total(Sum acc) {
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
  template <typename T>
  static V silu_times(V g, V u) {
    const V one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    const V magnitude = _mm256_and_ps(g, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
    const V e = exp_nonpositive(_mm256_sub_ps(zero, magnitude));
    const V numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
    const V silu = round_to(_mm256_div_ps(numerator, _mm256_add_ps(one, e)), static_cast<T*>(nullptr));
    return round_to(_mm256_mul_ps(silu, u), static_cast<T*>(nullptr));
  }
};
#endif
