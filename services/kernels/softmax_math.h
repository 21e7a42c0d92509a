// The softmax's exponential on 16 float32 lanes, shared by the attention kernels.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// 1 / i!, at namespace scope: as a constant local to the template below it crashed GCC 12 (an internal
// error in its fre pass) once inlined into the prefill kernel
inline constexpr float kTaylor[] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};

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

// e^x for x <= 0 (scores minus their maximum), clamped at e^-100.
inline __m512 exp_nonpositive(__m512 x) {
  return exp2_nonpositive(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504f)));
}
#endif
