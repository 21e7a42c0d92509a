// The int8 dot products' register tiles, shared by w8a8_linear.cpp (x rounded per row) and int8_digits_linear.cpp
// (x as three int8 digit rows): dots of MR <= kMR rows of int8 x against kNR rows of int8 W, exact in int32.
//
// Legend: Kp = K rounded up to kStep (x's rows are zero past K, W's are read only up to K), kStep = the columns of one
// vector step, kNR W rows (4 with AVX512-VNNI, 2 with AVX2), dots [kMR * kNR]: dots[kNR * i + j] = x row i . W row j
// + kOffset * sum_k x[i, k] (VNNI reads W's bytes as unsigned, w + 128; the caller takes kOffset * sum(x) off).
// `fetch`: the first tile to read these W rows also prefetches the next kNR rows (kNR * K bytes on) into L2.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

namespace {

constexpr int64_t kMR = 4;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kStep = 64, kNR = 4;

// acc += u (unsigned bytes) . v (signed), 4 pairs per int32 lane, in place: through its intrinsic GCC 12 copied each
// accumulator to another register and back around every vpdpbusd (and spilled some), ~1/3 of its rate.
inline void dpbusd(__m512i& acc, __m512i u, __m512i v) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(v)); }

// dots[4 i + j] = xq row i . W row j for MR rows of x, kNR of W. W's bytes as unsigned (w ^ 0x80 = w + 128), so
// vpdpbusd takes them against signed x; the caller subtracts 128 * sum(xq). The last step masks W past K. Every loop
// over the accumulators is unrolled by pragma, or GCC keeps them in memory.
template <int MR>
inline void tile(const int8_t* xq, int64_t Kp, const int8_t* const w[kNR], int64_t K, bool fetch, int32_t dots[16]) {
  __m512i acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask64 tail = K % kStep ? (__mmask64{1} << (K % kStep)) - 1 : ~__mmask64{0};
  for (int64_t k = 0; k < Kp; k += kStep) {
    const __mmask64 live = k + kStep <= K ? ~__mmask64{0} : tail;
    __m512i wv[kNR];
#pragma GCC unroll 4
    for (int j = 0; j < kNR; ++j) wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, w[j] + k), flip);
    if (fetch) {  // the first tile of x to read these W rows: the next tile's rows, 4 K bytes ahead, into L2
#pragma GCC unroll 4
      for (int j = 0; j < kNR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w[j] + kNR * K + k), _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_loadu_si512(xq + i * Kp + k);
#pragma GCC unroll 4
      for (int j = 0; j < kNR; ++j) dpbusd(acc[4 * i + j], wv[j], xv);
    }
  }
  // the 16 sums, in order: two rounds of unpack + add, two of 128-bit shuffles + add
  __m512i a[8], b[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2 * i], acc[2 * i + 1]),
                            _mm512_unpackhi_epi32(acc[2 * i], acc[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: partial sums of acc[4i .. 4i + 3]
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  const __m512i c0 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88), _mm512_shuffle_i32x4(b[0], b[1], 0xDD));
  const __m512i c1 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x88), _mm512_shuffle_i32x4(b[2], b[3], 0xDD));
  _mm512_storeu_si512(dots, _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, 0x88), _mm512_shuffle_i32x4(c0, c1, 0xDD)));
}
constexpr int32_t kOffset = 128;  // W's bytes were read as w + 128

#else  // AVX2: vpmaddubsw takes |w| (unsigned) against x with w's sign (vpsignb), pairs summed in int16
constexpr int64_t kStep = 32, kNR = 2;

// The 8 sums of v[0..7] (8 int32 lanes each), in order.
inline __m256i lane_sums8(__m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// dots[2 i + j] = xq row i . W row j. |w| |x| <= 127 * 127, so a pair's int16 sum (<= 32,258) cannot saturate;
// vpmaddwd by ones widens them to int32. W's tail past K is read by bytes into a zeroed step.
template <int MR>
inline void tile(const int8_t* xq, int64_t Kp, const int8_t* const w[kNR], int64_t K, bool fetch, int32_t dots[16]) {
  __m256i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t tail[kNR][kStep];
  for (int64_t k = 0; k < Kp; k += kStep) {
    __m256i wabs[kNR], wv[kNR];
    for (int j = 0; j < kNR; ++j) {
      const int8_t* p = w[j] + k;
      if (K - k < kStep) {
        std::fill(tail[j], tail[j] + kStep, 0);
        std::copy(p, w[j] + K, tail[j]);
        p = tail[j];
      }
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      wabs[j] = _mm256_abs_epi8(wv[j]);
      if (fetch) _mm_prefetch(reinterpret_cast<const char*>(w[j] + kNR * K + k), _MM_HINT_T1);  // as VNNI's tile
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * Kp + k));
      for (int j = 0; j < kNR; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(wabs[j], _mm256_sign_epi8(xv, wv[j]));
        acc[2 * i + j] = _mm256_add_epi32(acc[2 * i + j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots), lane_sums8(acc));
}
constexpr int32_t kOffset = 0;
#endif

}  // namespace

#endif  // AVX512-VNNI or AVX2
