// The skinny products' inner loop (skinny_linear.cpp): a few rows of x against R rows of W, in float32 lanes
// (FloatVec, vec_load.h) or, for bf16 pairs on CPUs with AVX512-BF16, by vdpbf16ps.
//
// Legend: MT <= kMaxTileM rows of x (`x_stride` elements apart), R W rows (`stride` apart, each K elements), kAcc
// accumulators per x row.
//   acc:  [MT, R] float32: acc[m][r] = dot(x[m, :], w[r * stride:][:K])
#pragma once

#include <cstdint>
#include <type_traits>

#include "vec_load.h"

namespace skinny_rows {

constexpr int kAcc = 4;  // accumulators per x row: R W rows x (kAcc / R) interleaved chunks of k
constexpr int64_t kMaxTileM = 4;  // x rows per pass over W (4 x 4 accumulators fit in registers)

// Where element k of a PairedBf16 row sits (see vec_load.h).
inline int64_t paired_index(int64_t k, int64_t K) {
  if (k >= K / 64 * 64) return k;
  const int64_t r = k % 64, lane = r / 16, i = r % 16;
  return k - r + (i < 8 ? 8 * lane + i : 32 + 8 * lane + i - 8);
}

#if defined(PDSERVE_FLOAT_VEC)
// The MT x kAcc accumulators (W row r uses r * kAcc / R ...), summed into acc[m][r].
template <typename Vec, int MT, int R>
inline void reduce_rows(typename Vec::V vacc[][kAcc], float acc[kMaxTileM][kAcc]) {
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) {
      typename Vec::V sum = vacc[m][r * (kAcc / R)];
      for (int a = 1; a < kAcc / R; ++a) sum = Vec::add(sum, vacc[m][r * (kAcc / R) + a]);
      acc[m][r] = Vec::sum(sum);
    }
}
#endif

// acc[m][r] = dot(x[m, :], w[r * stride:][:K]) for R W rows and m < MT x rows `x_stride` apart.
// R = 1: each thread reads its part of W as one sequential stream, kAcc accumulators over interleaved
// chunks of k hiding the FMA/dot latency. R = 4: four rows in flight, one accumulator each, plus a
// software prefetch of each row's successor in its stream (`next` elements on) with
// __builtin_prefetch's Locality: 3 (into every cache level) or 0 (non-temporal: W is read once per
// step; on a Zen 2 the kernel alone 5-10% faster on 2048-wide W, 2% slower on 8192-wide, a whole bf16
// `1b` decode step 7% faster, 91.9 -> 85.0 ms). The four rows are adjacent (stride K, each stream's
// next row 4 K on) or one from each quarter of the chunk's rows (`parts`: stride a quarter, next K
// on), whose streams DRAM serves from different pages at once (Zen 2, 2048-wide bf16 W: 5-10% faster
// than adjacent rows, 8192-wide the same). Which wins depends on the CPU and K (measured on a Zen 4:
// R = 1 for int8 and 2048-wide W, R = 4 for 8192-wide bf16), so all are candidates of the kernel plan.
template <typename X, typename W, int MT, int R, int Locality>
void dot_rows(const X* x, int64_t x_stride, const W* w, int64_t K, int64_t stride, int64_t next,
              float acc[kMaxTileM][kAcc]) {
  static_assert(R == 1 || R == kAcc, "one row with kAcc accumulators, or kAcc rows with one each");
  constexpr int kPhases = kAcc / R;  // accumulators per W row
  int64_t k = 0;
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<X, PairedBf16> && std::is_same_v<W, int8_t>) {
    // int8 -> bf16 without arithmetic: |q| indexes 128-entry tables of bf16(|q|)'s low and high
    // bytes (vpermi2b), q's sign goes into the high byte, and unpacking the two byte planes yields
    // 32 + 32 bf16 values in the paired order; then vdpbf16ps. 8 instructions per 64 weights
    // against 12 for int8 -> int32 -> float32 + FMA, which left the int8 kernel compute-bound.
    alignas(64) static const struct Tables {
      uint8_t lo[128], hi[128];
      Tables() {
        for (int v = 0; v < 128; ++v) {
          float f = static_cast<float>(v);
          uint32_t u;
          std::memcpy(&u, &f, 4);
          lo[v] = static_cast<uint8_t>(u >> 16);
          hi[v] = static_cast<uint8_t>(u >> 24);
        }
      }
    } tables;
    const __m512i lo_a = _mm512_load_si512(tables.lo), lo_b = _mm512_load_si512(tables.lo + 64);
    const __m512i hi_a = _mm512_load_si512(tables.hi), hi_b = _mm512_load_si512(tables.hi + 64);
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 vacc[MT][kAcc];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < kAcc; ++a) vacc[m][a] = _mm512_setzero_ps();
    const int64_t K64 = K / 64 * 64;
    for (int a = 0; k < K64; k += 64, a = (a + 1) % kPhases) {
      __m512bh wa[R], wb[R];
      for (int r = 0; r < R; ++r) {
        if (R > 1) __builtin_prefetch(w + r * stride + next + k, 0, Locality);
        const __m512i q = _mm512_loadu_si512(w + r * stride + k);
        const __m512i mag = _mm512_abs_epi8(q);
        const __m512i lo = _mm512_permutex2var_epi8(lo_a, mag, lo_b);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi_a, mag, hi_b), q, sign, 0xF8);
        wa[r] = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
        wb[r] = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512bh xa = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k);
        const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k + 32);
        for (int r = 0; r < R; ++r)
          vacc[m][r * kPhases + a] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(vacc[m][r * kPhases + a], xa, wa[r]), xb, wb[r]);
      }
    }
    reduce_rows<FloatVec, MT, R>(vacc, acc);
  } else
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, at::BFloat16> && std::is_same_v<W, at::BFloat16>) {
    __m512 vacc[MT][kAcc];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < kAcc; ++a) vacc[m][a] = _mm512_setzero_ps();
    for (int a = 0; k + 32 <= K; k += 32, a = (a + 1) % kPhases) {  // 32 bf16 pairs per instruction
      __m512bh wv[R];
      for (int r = 0; r < R; ++r) {
        if (R > 1) __builtin_prefetch(w + r * stride + next + k, 0, Locality);
        wv[r] = (__m512bh)_mm512_loadu_si512(w + r * stride + k);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k);
        for (int r = 0; r < R; ++r) vacc[m][r * kPhases + a] = _mm512_dpbf16_ps(vacc[m][r * kPhases + a], xv, wv[r]);
      }
    }
    reduce_rows<FloatVec, MT, R>(vacc, acc);
  } else
#endif
  {
#if defined(PDSERVE_FLOAT_VEC)
    if constexpr (!std::is_same_v<X, PairedBf16>) {  // both converted to float32, FloatVec::kLanes at a time
      constexpr int64_t L = FloatVec::kLanes;
      typename FloatVec::V vacc[MT][kAcc];
      for (int m = 0; m < MT; ++m)
        for (int a = 0; a < kAcc; ++a) vacc[m][a] = FloatVec::zero();
      auto step = [&](int a) {  // L elements of k into phase a's accumulators
        typename FloatVec::V wv[R];
        for (int r = 0; r < R; ++r) {
          if (R > 1 && (k * static_cast<int64_t>(sizeof(W))) % 64 == 0)
            __builtin_prefetch(w + r * stride + next + k, 0, Locality);
          wv[r] = FloatVec::load(w + r * stride + k);
        }
        for (int m = 0; m < MT; ++m) {
          const typename FloatVec::V xv = FloatVec::load(x + m * x_stride + k);
          for (int r = 0; r < R; ++r) vacc[m][r * kPhases + a] = FloatVec::fma(xv, wv[r], vacc[m][r * kPhases + a]);
        }
      };
      // Phases unrolled, so each accumulator is a named register, not a slot indexed at run time
      // (measured on a Zen 3: int8 W 2x faster); the last partial round continues the same order.
      for (; k + kPhases * L <= K; k += L) {
        step(0);
        for (int a = 1; a < kPhases; ++a) k += L, step(a);
      }
      for (int a = 0; k + L <= K; k += L, ++a) step(a);
      reduce_rows<FloatVec, MT, R>(vacc, acc);
    }
#endif
  }
  for (; k < K; ++k) {  // the tail (or, without AVX2 or AVX-512, everything: the compiler vectorizes it)
    const int64_t at = std::is_same_v<X, PairedBf16> ? paired_index(k, K) : k;
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R; ++r)
        acc[m][r] += scalar_to_float(x[m * x_stride + at]) * scalar_to_float(w[r * stride + k]);
  }
}

}  // namespace skinny_rows
