// Small register-tiled products for the attention kernels: c [rows, cols] (+)= a . b with float32
// accumulators, b pre-packed so that each 32-bit lane holds Pr elements of one column: bf16 pairs
// multiplied by vdpbf16ps (Pr = 2), or float32 by FMAs (Pr = 1).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pair_gemm {

template <typename E> inline constexpr int64_t kPair = 1;  // Pr of a packed element type
template <> inline constexpr int64_t kPair<at::BFloat16> = 2;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// 16 lanes of Pr elements each, and one lane's Pr elements broadcast to all 16.
inline __m512 lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline __m512 lanes(const at::BFloat16* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
inline __m512 broadcast(const at::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
}
// acc + the lane-wise products of a and b, each lane's Pr products summed
template <typename E> inline __m512 madd(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
#if defined(__AVX512BF16__)
template <> inline __m512 madd<at::BFloat16>(__m512 acc, __m512 a, __m512 b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
#endif

// c [RT, 16 VT] (+)= a [RT, steps * Pr] . b [steps, 16 VT * Pr] (float32 accumulators in registers;
// each step loads VT vectors of b once for the RT rows).
template <typename E, int RT, int VT>
inline void tile(const E* a, int64_t lda, const E* b, int64_t ldb, int64_t steps, float* c, int64_t ldc, bool add) {
  constexpr int64_t Pr = kPair<E>;
  __m512 acc[RT][VT];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < VT; ++v) acc[r][v] = add ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    __m512 bv[VT];
    for (int v = 0; v < VT; ++v) bv[v] = lanes(b + s * ldb + 16 * Pr * v);
    for (int r = 0; r < RT; ++r) {
      const __m512 x = broadcast(a + r * lda + s * Pr);
      for (int v = 0; v < VT; ++v) acc[r][v] = madd<E>(acc[r][v], bv[v], x);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < VT; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}

template <typename E, int RT, int VT>  // the last rows < RT of a column strip
inline void tail_rows(int64_t rows, const E* a, int64_t lda, const E* b, int64_t ldb, int64_t steps, float* c,
                      int64_t ldc, bool add) {
  if constexpr (RT > 0) {
    if (rows == RT) tile<E, RT, VT>(a, lda, b, ldb, steps, c, ldc, add);
    else tail_rows<E, RT - 1, VT>(rows, a, lda, b, ldb, steps, c, ldc, add);
  }
}

template <typename E, int VT>  // one strip of 16 VT columns, all rows; 16-ish accumulators per tile
inline void strip(int64_t rows, const E* a, int64_t lda, const E* b, int64_t ldb, int64_t steps, float* c,
                  int64_t ldc, bool add) {
  constexpr int RT = VT >= 4 ? 4 : 8;
  int64_t r = 0;
  for (; r + RT <= rows; r += RT) tile<E, RT, VT>(a + r * lda, lda, b, ldb, steps, c + r * ldc, ldc, add);
  tail_rows<E, RT - 1, VT>(rows - r, a + r * lda, lda, b, ldb, steps, c + r * ldc, ldc, add);
}
#endif

// c [rows, cols] = (add ? c : 0) + a [rows, steps * Pr] . b [steps, ldb / Pr >= cols, Pr] (b's Pr
// elements of a column adjacent).
template <typename E>
void gemm(const E* a, int64_t lda, const E* b, int64_t ldb, int64_t steps, float* c, int64_t ldc, int64_t rows,
          int64_t cols, bool add) {
  constexpr int64_t Pr = kPair<E>;
  int64_t col = 0;
#if defined(__AVX512F__)
  for (; col + 64 <= cols; col += 64) strip<E, 4>(rows, a, lda, b + col * Pr, ldb, steps, c + col, ldc, add);
  for (; col + 32 <= cols; col += 32) strip<E, 2>(rows, a, lda, b + col * Pr, ldb, steps, c + col, ldc, add);
  for (; col + 16 <= cols; col += 16) strip<E, 1>(rows, a, lda, b + col * Pr, ldb, steps, c + col, ldc, add);
#endif
  for (int64_t r = 0; r < rows && col < cols; ++r) {  // the columns left over (Dh not a multiple of 16)
    if (!add) std::fill(c + r * ldc + col, c + r * ldc + cols, 0.f);
    for (int64_t s = 0; s < steps * Pr; ++s) {
      const float x = to_float(a[r * lda + s]);
      for (int64_t j = col; j < cols; ++j) c[r * ldc + j] += x * to_float(b[(s / Pr) * ldb + j * Pr + s % Pr]);
    }
  }
}

}  // namespace pair_gemm
