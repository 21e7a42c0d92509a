// Group-wise int4 weights (services/int4_weight.py), shared by the int4 kernels: the layout, one row's
// group parameters, a block as bf16 words (bf16 x in their order: int4_slot_x.h), a row dequantized, and the
// argument checks.
//
// Legend: N output features, Kp = K padded to whole 64-column blocks, G = 32 columns per group.
//   packed: [N, Kp / 2] uint8 (block b of row n: 32 bytes; see int4_linear.cpp for the order)
//   scale, low: [N, Kp / G] float16: w[n, k] = q * scale[n, k / G] + low[n, k / G], q in 0..15
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace int4 {

constexpr int64_t kGroup = 32, kBlock = 64;

// Where column e (0..63) of a block sits: register r (0: unpacklo's words, 1: unpackhi's), word w of it.
// Words pair up in vdpbf16ps lanes (lane j: words 2j, 2j + 1); even lanes hold the block's first group
// (columns 0..31), odd lanes its second (32..63), so one product of a pair of registers covers both
// groups and one FMA by [scale_a, scale_b, scale_a, ...] (a 2-float broadcast) scales them.
inline void block_slot(int e, int& r, int& w) {
  const int group = e / 32, within = e % 32;
  r = within / 16;
  w = 4 * ((within % 16) / 2) + 2 * group + within % 2;
}
// The nibble byte of column e: unpacklo/hi take bytes 16L + 0..7 / 16L + 8..15 of 128-bit lane L.
inline int block_order(int e) {
  int r, w;
  block_slot(e, r, w);
  return 16 * (w / 8) + w % 8 + 8 * r;
}
// The column whose nibble lies in byte `byte` of a block (block_order's inverse).
inline int block_column(int byte) {
  static const std::array<int, kBlock> column = [] {
    std::array<int, kBlock> c{};
    for (int e = 0; e < kBlock; ++e) c[block_order(e)] = e;
    return c;
  }();
  return column[byte];
}

// One row's group parameters as float32 ([Kp / G] each).
inline void row_params(const at::Half* scale, const at::Half* low, int64_t groups, float* sc, float* lo) {
  int64_t g = 0;
#if defined(__AVX512F__)
  for (; g + 16 <= groups; g += 16) {  // 16 at a time: a scalar half conversion costs more than a block's dot
    _mm512_storeu_ps(sc + g, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g))));
    _mm512_storeu_ps(lo + g, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + g))));
  }
#elif defined(__F16C__) && defined(__AVX2__)
  for (; g + 8 <= groups; g += 8) {
    _mm256_storeu_ps(sc + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g))));
    _mm256_storeu_ps(lo + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + g))));
  }
#endif
  for (; g < groups; ++g) {
    sc[g] = static_cast<float>(scale[g]);
    lo[g] = static_cast<float>(low[g]);
  }
}

#if defined(__AVX512BW__)
// Block b's 64 nibbles, one a byte, in block_order's bytes.
inline __m512i block_nibbles(const uint8_t* packed, int64_t b) {
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + b * 32)));
  return _mm512_and_si512(_mm512_srlv_epi16(raw, shifts), _mm512_set1_epi8(0x0F));
}

// Block b's 64 columns as two registers of 32 bf16 words 0x43qq = 128 + q, in block_slot's order.
inline void block_words(const uint8_t* packed, int64_t b, __m512i& wa, __m512i& wb) {
  const __m512i nibbles = block_nibbles(packed, b);
  wa = _mm512_unpacklo_epi8(nibbles, _mm512_set1_epi8(0x43));  // r = 0: columns 0..15 and 32..47 of the block
  wb = _mm512_unpackhi_epi8(nibbles, _mm512_set1_epi8(0x43));  // r = 1: columns 16..31 and 48..63
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Block b's nibbles as indices into group_values' words: in block_order's bytes, 16 added in the second group's.
inline __m512i group_indices(const uint8_t* packed, int64_t b) {
  struct Offsets {
    alignas(64) uint8_t by_byte[kBlock];  // 16 where the byte's column is in the second group
  };
  static const Offsets offsets = [] {
    Offsets o{};
    for (int e = 0; e < kBlock; ++e) o.by_byte[block_order(e)] = e >= kGroup ? 16 : 0;
    return o;
  }();
  return _mm512_or_si512(block_nibbles(packed, b), _mm512_load_si512(offsets.by_byte));
}

// Block b's two groups' 16 values each, bf16(fma(q, scale, low)), as 32 words (0-15 the first group's).
inline __m512i group_values(const float* sc, const float* lo, int64_t b) {
  const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 first = _mm512_fmadd_ps(q, _mm512_set1_ps(sc[2 * b]), _mm512_set1_ps(lo[2 * b]));
  const __m512 second = _mm512_fmadd_ps(q, _mm512_set1_ps(sc[2 * b + 1]), _mm512_set1_ps(lo[2 * b + 1]));
  return (__m512i)_mm512_cvtne2ps_pbh(second, first);
}

// Block b of one row as 64 bf16 in column order (out [64]): bf16(fma(q, scale, low)) of each column's group, the values
// dequantize_row + store_row give. A group has only 16 values, so they are made once (one FMA a group) into a table of
// 32 words, and each column's nibble picks its word (vpermw): the nibbles widened to words, put in column order by two
// word permutes, offset by 16 in the second group. Against converting each column (a float conversion, an FMA and a
// rounding per 16): 32 rows x 16384 x 2048 on the tile unit 6.5 -> 2.0 ms (amx_rows.h, Intel Xeon family 6 model 207).
// sc, lo: the row's group parameters as float32 (row_params).
inline void block_bf16(const uint8_t* packed, int64_t b, const float* sc, const float* lo, at::BFloat16* out) {
  struct Order {
    alignas(64) uint16_t column_byte[kBlock];  // column e's byte in the indices (block_order)
  };
  static const Order order_of = [] {
    Order o{};
    for (int e = 0; e < kBlock; ++e) o.column_byte[e] = static_cast<uint16_t>(block_order(e));
    return o;
  }();
  const __m512i index = group_indices(packed, b);
  const __m512i lo_words = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(index));
  const __m512i hi_words = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(index, 1));
  const __m512i table = group_values(sc, lo, b);
  for (int half = 0; half < 2; ++half) {  // columns 32 half .. 32 half + 31
    const __m512i order = _mm512_load_si512(order_of.column_byte + 32 * half);
    const __m512i column_index = _mm512_permutex2var_epi16(lo_words, order, hi_words);
    _mm512_storeu_si512(out + 32 * half, _mm512_permutexvar_epi16(column_index, table));
  }
}
#endif

// One row of W as float32 (out: [Kp]), in column order.
inline void dequantize_row(const uint8_t* packed, const float* sc, const float* lo, int64_t Kp, float* out) {
#if defined(__AVX512BW__)
  for (int64_t b = 0; b < Kp / kBlock; ++b) {
    __m512i words[2];
    block_words(packed, b, words[0], words[1]);
    // 16 words at a time: bf16 -> float32 is a shift, q = that - 128; the words of half h of register r
    // are columns 16r + 8h + 0..7 of each group, pairwise interleaved: sorted into [group a x 8, group b x 8]
    const __m512i sort = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(sc[2 * b]), _mm256_set1_ps(sc[2 * b + 1]), 1);
    const __m512 low = _mm512_insertf32x8(_mm512_set1_ps(lo[2 * b]), _mm256_set1_ps(lo[2 * b + 1]), 1);
    for (int r = 0; r < 2; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m256i part = _mm512_extracti64x4_epi64(words[r], 0), part_hi = _mm512_extracti64x4_epi64(words[r], 1);
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h ? part_hi : part), 16));
        const __m512 q = _mm512_permutexvar_ps(sort, _mm512_sub_ps(v, _mm512_set1_ps(128.f)));
        const __m512 w = _mm512_fmadd_ps(q, scale, low);
        float* at = out + b * kBlock + 16 * r + 8 * h;
        _mm256_storeu_ps(at, _mm512_castps512_ps256(w));
        _mm256_storeu_ps(at + 32, _mm512_extractf32x8_ps(w, 1));
      }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // Per 128-bit lane, the bytes of the columns of (group, r) = (0, 0), (0, 1), (1, 0), (1, 1), four each
  // (block_slot), then the lanes' halves paired: 8 bytes = 8 consecutive columns per (group, r).
  const __m256i gather = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const __m256i pair_lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < Kp / kBlock; ++b) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + b * 32));
    for (int h = 0; h < 2; ++h) {  // low nibbles: columns 0..7 of each (group, r); high: 8..15
      const __m256i nibbles = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, mask);
      const __m256i sorted = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(nibbles, gather), pair_lanes);
      for (int c = 0; c < 4; ++c) {
        const int group = c / 2, r = c % 2;
        const __m128i part = c < 2 ? _mm256_castsi256_si128(sorted) : _mm256_extracti128_si256(sorted, 1);
        const __m128i eight = r ? _mm_unpackhi_epi64(part, part) : part;
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
        const __m256 w = _mm256_fmadd_ps(q, _mm256_set1_ps(sc[2 * b + group]), _mm256_set1_ps(lo[2 * b + group]));
        _mm256_storeu_ps(out + b * kBlock + 32 * group + 16 * r + 8 * h, w);
      }
    }
  }
#else
  for (int64_t b = 0; b < Kp / kBlock; ++b) {
    const uint8_t* bytes = packed + b * 32;
    for (int e = 0; e < kBlock; ++e) {
      const int p = block_order(e);
      const int q = p < 32 ? bytes[p] & 15 : bytes[p - 32] >> 4;
      const int64_t g = (b * kBlock + e) / kGroup;
      out[b * kBlock + e] = q * sc[g] + lo[g];
    }
  }
#endif
}

// out[:K] = row[:K] in out's dtype (round to nearest even, as torch's conversions do).
inline void store_row(const float* row, float* out, int64_t K) { std::copy(row, row + K, out); }
inline void store_row(const float* row, at::Half* out, int64_t K) {
  for (int64_t k = 0; k < K; ++k) out[k] = static_cast<at::Half>(row[k]);
}
inline void store_row(const float* row, at::BFloat16* out, int64_t K) {
  int64_t k = 0;
#if defined(__AVX512BF16__)
  for (; k + 16 <= K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
#endif
  for (; k < K; ++k) out[k] = static_cast<at::BFloat16>(row[k]);
}

struct Int4Args {
  torch::Tensor packed, scale, low;
  int64_t N, Kp, groups;
};

inline Int4Args check(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu(),
              "packed must be a contiguous CPU uint8 [N, Kp / 2]");
  const int64_t N = packed.size(0), Kp = packed.size(1) * 2;
  TORCH_CHECK(Kp % kBlock == 0, "packed rows must hold whole 64-column blocks, got ", Kp, " columns");
  for (const auto* t : {&scale, &low})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) * kGroup == Kp,
                "scale and low must be contiguous float16 [N, Kp / 32]");
  return {packed, scale, low, N, Kp, Kp / kGroup};
}

// The checks of a product x [M, K] @ W^T, W's columns padded to Kp (K within its last block).
inline Int4Args check_product(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                              const torch::Tensor& low) {
  const Int4Args w = check(packed, scale, low);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) <= w.Kp && x.size(1) > w.Kp - kBlock,
              "x [M, K] expected with K within the weight's last 64-column block");
  return w;
}

// x [M, K] widened to W's padded width: [M, Kp], zero past K.
inline torch::Tensor padded_x(const torch::Tensor& x, int64_t Kp) {
  torch::Tensor xp = torch::zeros({x.size(0), Kp}, x.options());
  xp.narrow(1, 0, x.size(1)).copy_(x);
  return xp;
}

}  // namespace int4
