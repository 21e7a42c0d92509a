// The softmax's exponential on 16 float32 lanes, shared by the attention kernels.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x for x <= 0 (scores minus their maximum): 2^(x log2 e) split into an integer power, applied
// exactly by vscalefps, and 2^f for |f| <= 1/2 by its degree-6 Taylor polynomial (error ~1e-7).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif
