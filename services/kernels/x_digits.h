// Rows of x in 21-bit fixed point, as three int8 digit rows each: what int8 weights multiply by integer dot products
// (int8_digits_linear.cpp) when x is float32, bf16 or fp16.
//
// Legend: M rows of x [M, K], Kp = K rounded up to the caller's vector step.
//   u:   [M] float32    row m's unit 2^(e - 14), 2^e the least power of two with 127 * 2^e >= max_k |x[m, k]| (and
//                       >= 2^-100); a zero row: 1; a row holding an infinity or a NaN: NaN (its outputs are NaN)
//   X:   round(x / u)   halves to even; exact (u is a power of two) and |X| <= 127 * 2^14
//   q:   [3M, Kp] int8  rows 3m, 3m + 1, 3m + 2: X's balanced base-128 digits, X = (q0 * 128 + q1) * 128 + q2 with
//                       q1, q2 in [-64, 63] and |q0| <= 127; zeros past K
//   sum: [3M] int32     each digit row's sum (what W's unsigned bytes cost the VNNI dots, int8_dot_tiles.h)
//
// Why: an element is off by at most u / 2 < max|x| * 2^-20, and exact wherever it is within 2^12 of its row's
// largest in bf16 (2^9 in fp16): the weight-only product up to far less than x's own rounding (int8_x16_linear's
// x, int16 per 32 columns, is exact within 2^7 of its group's largest). And three int8 rows cost the dot products
// little more than one where W's bytes are the stream: each W vector is loaded once for all of them.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_rounding.h"  // row_amax
#include "vec_load.h"

namespace {

struct XDigits {
  std::vector<int8_t> q;  // [3M, Kp]
  std::vector<float> u;  // [M]
  std::vector<int32_t> sum;  // [3M]
  int64_t Kp;
};

// The legend's unit for a row whose largest magnitude is amax (NaN where amax is not finite).
inline float unit_of(float amax) {
  if (!std::isfinite(amax)) return NAN;
  if (amax == 0.f) return 1.f;
  const float least = std::ldexp(1.f, -100);
  float p = std::max(std::ldexp(1.f, std::ilogb(amax) - 7), least);  // at most 2^e: 127 p < amax or p = least
  while (127.f * p < amax) p *= 2.f;  // 127 times a power of two is exact (or inf past FLT_MAX: then p is 2^e)
  return std::ldexp(p, -14);
}

// X's three digits (the legend's), in scalar code.
inline void split(int32_t X, int8_t* q0, int8_t* q1, int8_t* q2, int32_t* sums) {
  const int32_t d2 = ((X + 64) & 127) - 64, X1 = (X - d2) / 128, d1 = ((X1 + 64) & 127) - 64, d0 = (X1 - d1) / 128;
  *q0 = static_cast<int8_t>(d0), *q1 = static_cast<int8_t>(d1), *q2 = static_cast<int8_t>(d2);
  sums[0] += d0, sums[1] += d1, sums[2] += d2;
}

#if defined(__AVX512F__)
// The digits of 16 lanes of X (the same integer operations as split), stored at q0, q1, q2 [16]; sums accumulated.
inline void split_lanes(__m512i X, int8_t* q0, int8_t* q1, int8_t* q2, __m512i sums[3]) {
  const __m512i c64 = _mm512_set1_epi32(64), c127 = _mm512_set1_epi32(127);
  const __m512i d2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, c64), c127), c64);
  const __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, d2), 7);  // exact: X - d2 is a multiple of 128
  const __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X1, c64), c127), c64);
  const __m512i d0 = _mm512_srai_epi32(_mm512_sub_epi32(X1, d1), 7);
  const __m512i d[3] = {d0, d1, d2};
  int8_t* out[3] = {q0, q1, q2};
  for (int i = 0; i < 3; ++i) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[i]), _mm512_cvtepi32_epi8(d[i]));
    sums[i] = _mm512_add_epi32(sums[i], d[i]);
  }
}
inline __m512i fixed_lanes(__m512 v, __m512 inv) { return _mm512_cvtps_epi32(_mm512_mul_ps(v, inv)); }
inline bool finite_lanes(__m512 zeroed) { return _mm512_reduce_add_ps(zeroed) == 0.f; }  // v * 0 summed: 0 or NaN
#else
inline void split_lanes(__m256i X, int8_t* q0, int8_t* q1, int8_t* q2, __m256i sums[3]) {  // as above, 8 lanes
  const __m256i c64 = _mm256_set1_epi32(64), c127 = _mm256_set1_epi32(127);
  const __m256i d2 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X, c64), c127), c64);
  const __m256i X1 = _mm256_srai_epi32(_mm256_sub_epi32(X, d2), 7);
  const __m256i d1 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X1, c64), c127), c64);
  const __m256i d0 = _mm256_srai_epi32(_mm256_sub_epi32(X1, d1), 7);
  const __m256i d[3] = {d0, d1, d2};
  int8_t* out[3] = {q0, q1, q2};
  for (int i = 0; i < 3; ++i) {
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(d[i]), _mm256_extracti128_si256(d[i], 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out[i]), _mm_packs_epi16(words, words));
    sums[i] = _mm256_add_epi32(sums[i], d[i]);
  }
}
inline __m256i fixed_lanes(__m256 v, __m256 inv) { return _mm256_cvtps_epi32(_mm256_mul_ps(v, inv)); }
inline bool finite_lanes(__m256 zeroed) { return sum8(zeroed) == 0.f; }
#endif

// Row x [K] as the legend's digits, into q0, q1, q2 [Kp] (zeroed by the caller) and sums [3]; returns its unit.
template <typename T>
float digit_row(const T* x, int64_t K, int8_t* q0, int8_t* q1, int8_t* q2, int32_t* sums) {
  using V = FloatVec;
  using I = decltype(fixed_lanes(V::zero(), V::zero()));
  constexpr int64_t L = V::kLanes;
  const float u = unit_of(row_amax(x, K));
  const float inv = 1.f / u;  // a power of two: x * inv is x / u exactly
  const int64_t whole = K / L * L;
  I vsums[3] = {I{}, I{}, I{}};
  V::V zeroed = V::zero();
  for (int64_t k = 0; k < whole; k += L) {
    const V::V v = V::load(x + k);
    zeroed = V::fma(v, V::zero(), zeroed);  // NaN from an infinity or a NaN (row_amax may have lost a NaN)
    split_lanes(fixed_lanes(v, V::set1(inv)), q0 + k, q1 + k, q2 + k, vsums);
  }
  for (int i = 0; i < 3; ++i) {
    alignas(64) int32_t lanes[L];
    std::memcpy(lanes, &vsums[i], sizeof(lanes));
    for (int64_t l = 0; l < L; ++l) sums[i] += lanes[l];
  }
  bool finite = finite_lanes(zeroed);
  for (int64_t k = whole; k < K; ++k) {
    const float v = scalar_to_float(x[k]), fixed = v * inv;
    finite = finite && std::isfinite(v);
    split(static_cast<int32_t>(std::nearbyint(std::isfinite(fixed) ? fixed : 0.f)), q0 + k, q1 + k, q2 + k, sums);
  }
  return finite ? u : NAN;
}

template <typename T>
XDigits digit_rows(const T* x, int64_t M, int64_t K, int64_t step) {
  XDigits d;
  d.Kp = (K + step - 1) / step * step;
  d.q.assign(3 * M * d.Kp, 0);
  d.u.resize(M);
  d.sum.assign(3 * M, 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* q = d.q.data() + 3 * m * d.Kp;
      d.u[m] = digit_row(x + m * K, K, q, q + d.Kp, q + 2 * d.Kp, d.sum.data() + 3 * m);
    }
  });
  return d;
}

}  // namespace
