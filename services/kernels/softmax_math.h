// The softmax's exponential on 16 float32 lanes (AVX-512) or 8 (AVX2), shared by the attention kernels.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// 1 / i!, at namespace scope: as a constant local to the template below it crashed GCC 12 (an internal
// error in its fre pass) once inlined into the prefill kernel
inline constexpr float kTaylor[] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};

#if defined(__AVX512F__)

// 2^t for t <= 0: the integer part of t applied exactly by vscalefps, 2^f for |f| <= 1/2 as e^(f ln 2)
// by its Taylor polynomial of degree Degree (error ~1e-7 at 6; ~4e-5 at 4, far below bf16's 4e-3).
template <int Degree = 6>
inline __m512 exp2_nonpositive(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // f ln 2
  __m512 p = _mm512_set1_ps(kTaylor[Degree]);
  for (int i = Degree - 1; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

// Sixteen vectors' lanes folded by `op` (_mm512_add_ps, _mm512_max_ps) into one vector, lane c from v[c]: a
// transposing tree of 45 instructions, against a horizontal reduction (~8, each a chain of shuffles) per vector.
template <typename Op>
inline __m512 fold_lanes16(const __m512 v[16], Op op) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i]'s partial results at 0 and 2, v[2i + 1]'s at 1 and 3
    a[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: v[4i .. 4i + 3]'s partial results
    b[i] = op(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  // the 128-bit lanes folded, b[i]'s into lane i
  const __m512 c0 = op(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = op(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return op(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// e^x for x <= 0 (scores minus their maximum), clamped at e^-100.
inline __m512 exp_nonpositive(__m512 x) {
  return exp2_nonpositive(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504f)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 2^t for t <= 0 on 8 lanes, as above, 2^n written into the exponent bits, which stop at 2^-126: t is clamped
// there (the smallest result, ~1e-38, is nothing next to the maximum's 2^0).
template <int Degree = 6>
inline __m256 exp2_nonpositive(__m256 t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147181f));  // f ln 2
  __m256 p = _mm256_set1_ps(kTaylor[Degree]);
  for (int i = Degree - 1; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kTaylor[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// e^x for x <= 0, clamped at -87 (e^-87 ~ 1.6e-38).
inline __m256 exp_nonpositive(__m256 x) {
  return exp2_nonpositive(_mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.44269504f)));
}
#endif
