// Small register-tiled products for the attention kernels: c [rows, cols] (+)= a . b with float32
// accumulators, b pre-packed so that each 32-bit lane holds Pr elements of one column: bf16 pairs
// multiplied by vdpbf16ps (Pr = 2), or float32 by FMAs (Pr = 1); 16 lanes with AVX-512, 8 with AVX2.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pair_gemm {

template <typename E> inline constexpr int64_t kPair = 1;  // Pr of a packed element type
template <> inline constexpr int64_t kPair<at::BFloat16> = 2;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// 16 lanes of Pr elements each, and one lane's Pr elements broadcast to all 16.
using Vec = __m512;
constexpr int64_t kLanes = 16, kMaxVT = 4;  // 32 registers: up to 4 x 4 tiles (16 accumulators)
inline Vec lanes(const float* p) { return _mm512_loadu_ps(p); }
inline Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec lanes(const at::BFloat16* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
inline Vec broadcast(const at::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
}
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// acc + the lane-wise products of a and b, each lane's Pr products summed
template <typename E> inline Vec madd(Vec acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
#if defined(__AVX512BF16__)
template <> inline Vec madd<at::BFloat16>(Vec acc, Vec a, Vec b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
#endif
template <int VT> inline constexpr int kRows = VT >= 4 ? 4 : 8;  // rows per tile: ~16 accumulators
#elif defined(__AVX2__) && defined(__FMA__)
// 8 float32 lanes (no 16-bit products here: the kernels pack float32, Pr = 1)
using Vec = __m256;
constexpr int64_t kLanes = 8, kMaxVT = 2;  // 16 registers: 6 x 2 tiles (12 accumulators, 2 of b, 1 of a)
inline Vec lanes(const float* p) { return _mm256_loadu_ps(p); }
inline Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
template <typename E> inline Vec madd(Vec acc, Vec a, Vec b) { return _mm256_fmadd_ps(a, b, acc); }
template <int VT> inline constexpr int kRows = VT >= 2 ? 6 : 8;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAIR_GEMM_VECTORS 1
// c [RT, kLanes VT] (+)= a [RT, steps * Pr] . b [steps, kLanes VT * Pr] (float32 accumulators in registers;
// each step loads VT vectors of b once for the RT rows). The loops are unrolled by pragma so that GCC keeps
// the accumulators in registers.
template <typename E, int RT, int VT>
inline void tile(const E* a, int64_t lda, const E* b, int64_t ldb, int64_t steps, float* c, int64_t ldc, bool add) {
  constexpr int64_t Pr = kPair<E>;
  Vec acc[RT][VT];
#pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < VT; ++v) acc[r][v] = add ? load(c + r * ldc + kLanes * v) : zero();
  for (int64_t s = 0; s < steps; ++s) {
    Vec bv[VT];
#pragma GCC unroll 4
    for (int v = 0; v < VT; ++v) bv[v] = lanes(b + s * ldb + kLanes * Pr * v);
#pragma GCC unroll 8
    for (int r = 0; r < RT; ++r) {
      const Vec x = broadcast(a + r * lda + s * Pr);
#pragma GCC unroll 4
      for (int v = 0; v < VT; ++v) acc[r][v] = madd<E>(acc[r][v], bv[v], x);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < VT; ++v) store(c + r * ldc + kLanes * v, acc[r][v]);
}

template <typename E, int RT, int VT>  // the last rows < RT of a column strip
inline void tail_rows(int64_t rows, const E* a, int64_t lda, const E* b, int64_t ldb, int64_t steps, float* c,
                      int64_t ldc, bool add) {
  if constexpr (RT > 0) {
    if (rows == RT) tile<E, RT, VT>(a, lda, b, ldb, steps, c, ldc, add);
    else tail_rows<E, RT - 1, VT>(rows, a, lda, b, ldb, steps, c, ldc, add);
  }
}

template <typename E, int VT>  // one strip of kLanes VT columns, all rows
inline void strip(int64_t rows, const E* a, int64_t lda, const E* b, int64_t ldb, int64_t steps, float* c,
                  int64_t ldc, bool add) {
  constexpr int RT = kRows<VT>;
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
#if defined(PAIR_GEMM_VECTORS)
  if constexpr (kMaxVT >= 4)
    for (; col + 4 * kLanes <= cols; col += 4 * kLanes)
      strip<E, 4>(rows, a, lda, b + col * Pr, ldb, steps, c + col, ldc, add);
  for (; col + 2 * kLanes <= cols; col += 2 * kLanes)
    strip<E, 2>(rows, a, lda, b + col * Pr, ldb, steps, c + col, ldc, add);
  for (; col + kLanes <= cols; col += kLanes)
    strip<E, 1>(rows, a, lda, b + col * Pr, ldb, steps, c + col, ldc, add);
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
