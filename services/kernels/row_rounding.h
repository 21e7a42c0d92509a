// Rows of x rounded to int8, each with its own scale (w8a8's activations): xs[m] = max(max_k |x[m, k]|, 1e-30) / 127
// (float32), xq[m, k] = round(x[m, k] / xs[m]) (halves to even), as linear_candidates._int8_dynamic_mm rounds them.
// Legend: x [M, K] float32 / bf16 / fp16; q [M, Kp] int8 (Kp = K rounded up to the caller's vector step, zeros past
// K), s [M] xs, sum [M] sum_k xq[m, k]. Needs AVX-512 (F, BW) or AVX2 + FMA + F16C; included by w8a8_linear.cpp
// and w8a8_matmul_parts.cpp.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_load.h"

namespace {

struct RoundedX {
  std::vector<int8_t> q;  // [M, Kp], zeros past K
  std::vector<float> s;   // [M] xs
  std::vector<int32_t> sum;  // [M] sum_k xq[m, k] (VNNI: the offset of W's unsigned bytes)
  int64_t Kp;
};

#if defined(__AVX512F__)
using IntVec = __m512i;
inline __m512 abs_max(__m512 m, __m512 v) { return _mm512_max_ps(m, _mm512_abs_ps(v)); }
// round(v / s) in each lane, halves to even (vcvtps2dq's default mode, as torch.round): into q [16], and as int32
inline __m512i round_lanes(__m512 v, __m512 s, int8_t* q) {
  const __m512i i = _mm512_cvtps_epi32(_mm512_div_ps(v, s));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i));
  return i;
}
inline __m512i add_ints(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
#else
using IntVec = __m256i;
inline __m256 abs_max(__m256 m, __m256 v) { return _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v)); }
inline __m256i round_lanes(__m256 v, __m256 s, int8_t* q) {  // as above, into q [8]
  const __m256i i = _mm256_cvtps_epi32(_mm256_div_ps(v, s));
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(words, words));
  return i;
}
inline __m256i add_ints(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
#endif

// max_k |x[k]| of a row of K, as float32 (a NaN in the row may or may not survive the max).
template <typename T>
float row_amax(const T* x, int64_t K) {
  using V = FloatVec;
  constexpr int64_t L = V::kLanes;
  const int64_t whole = K / L * L;
  V::V vmax = V::zero();
  for (int64_t k = 0; k < whole; k += L) vmax = abs_max(vmax, V::load(x + k));
  alignas(64) float lanes[L];
  V::store(lanes, vmax);
  float amax = 0.f;
  for (int64_t l = 0; l < L; ++l) amax = std::max(amax, lanes[l]);
  for (int64_t k = whole; k < K; ++k) amax = std::max(amax, std::fabs(scalar_to_float(x[k])));
  return amax;
}

// Row m of x as the legend rounds it, into q [Kp]; returns xs and sets *sum. The division as torch's (exact, not by
// a reciprocal); values past the last whole vector in scalar code (nearbyint: halves to even).
template <typename T>
float round_row(const T* x, int64_t K, int8_t* q, int32_t* sum) {
  using V = FloatVec;
  constexpr int64_t L = V::kLanes;
  const int64_t whole = K / L * L;
  const float s = std::max(row_amax(x, K), 1e-30f) / 127.f;
  IntVec total = IntVec{};
  for (int64_t k = 0; k < whole; k += L) total = add_ints(total, round_lanes(V::load(x + k), V::set1(s), q + k));
  alignas(64) int32_t ints[L];
  std::memcpy(ints, &total, sizeof(total));
  int32_t sum_q = 0;
  for (int64_t l = 0; l < L; ++l) sum_q += ints[l];
  for (int64_t k = whole; k < K; ++k) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(scalar_to_float(x[k]) / s));
    q[k] = static_cast<int8_t>(v);
    sum_q += v;
  }
  *sum = sum_q;
  return s;
}

// y[m, n] from its exact dot: float(dot) * xs[m] * scale[n] rounded to y's dtype, then + bias rounded again (torch adds
// the bias after the rounding). Its includers build with fp-contract off: two roundings, as torch's operators.
template <typename T>
inline void w8a8_value(int32_t dot, float xs, float scale, const T* bias, T* y) {
  const float v = static_cast<float>(dot) * xs * scale;
  if constexpr (std::is_same_v<T, float>) {
    *y = bias ? v + *bias : v;
  } else {
    const T r = static_cast<T>(v);
    *y = bias ? static_cast<T>(static_cast<float>(r) + static_cast<float>(*bias)) : r;
  }
}

template <typename T>
RoundedX round_rows(const T* x, int64_t M, int64_t K, int64_t step) {
  RoundedX r;
  r.Kp = (K + step - 1) / step * step;
  r.q.assign(M * r.Kp, 0);
  r.s.resize(M);
  r.sum.resize(M);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) r.s[m] = round_row(x + m * K, K, r.q.data() + m * r.Kp, &r.sum[m]);
  });
  return r;
}

}  // namespace
