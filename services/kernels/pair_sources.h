// Where pair_tiled_linear.cpp's W comes from: the per-thread panel [KC / 2, NR] (int32 bf16 pairs, lane n of entry
// j the pair (W[n0 + n, k0 + 2j], W[n0 + n, k0 + 2j + 1]), zeros past N and K) of one chunk of NR W rows, and the next
// chunk's bytes fetched into L2 while the current one is multiplied.
//   Row layouts (Bf16Rows, Int8Rows, Int4Rows): a chunk of each of W's rows converted to bf16 into rows [NR, KC],
//   then transposed (pack_panel, transpose16.h);
//   Int8PanelPairs: int8_panels.py's copy of a weight-only int8 weight ([P, K4, 16] int32, lane r of entry (p, j)
//   W[16p + r, 4j .. 4j + 3] + 128 as four bytes), whose entries are already a row a lane: two panels make NR rows,
//   each entry two pair entries, no transpose. The same exact integers as Int8Rows gives: the same product bit for bit.
#pragma once

#include <torch/extension.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "int4_block.h"
#include "int8_panel_copy.h"
#include "transpose16.h"

namespace pair_sources {

constexpr int64_t kNR = 32, kKC = 128;

// panel [KC / 2, NR] from rows [NR, KC] (bf16, row-major)
inline void pack_panel(const at::BFloat16* rows, int32_t* panel) {
  for (int half = 0; half < 2; ++half)
    for (int64_t j0 = 0; j0 < kKC / 2; j0 += 16) {
      __m512i in[16], out[16];
      for (int r = 0; r < 16; ++r) in[r] = _mm512_loadu_si512(rows + (16 * half + r) * kKC + 2 * j0);
      transpose16(in, out);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(panel + (j0 + j) * kNR + 16 * half, out[j]);
    }
}

// bytes from p on into the L2 cache (lines past the end of a row may be fetched: only ever read within the tensor
// or its allocation's last line)
inline void fetch_bytes(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at, 0, 2);
}

// One chunk of W row n (columns k0 .. k0 + KC, zeros past K) as bf16, into out [KC], for each weight format.
struct Bf16Rows {
  const at::BFloat16* w;
  int64_t K;
  void row(int64_t n, int64_t k0, at::BFloat16* out) const {
    const int64_t len = std::clamp<int64_t>(K - k0, 0, kKC);
    std::memcpy(out, w + n * K + k0, len * sizeof(at::BFloat16));
    std::fill(out + len, out + kKC, at::BFloat16(0.f));
  }
  void fetch(int64_t n, int64_t k0) const { fetch_bytes(w + n * K + k0, std::min<int64_t>(K - k0, kKC) * 2); }
};

struct Int8Rows {
  const int8_t* w;
  int64_t K;
  void row(int64_t n, int64_t k0, at::BFloat16* out) const {  // exact: |w| <= 127 fits bf16's 8 bits
    const int8_t* src = w + n * K + k0;
    const int64_t len = std::clamp<int64_t>(K - k0, 0, kKC);
    int64_t k = 0;
    for (; k + 32 <= len; k += 32) {
      const __m128i* at = reinterpret_cast<const __m128i*>(src + k);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at + 1)));
      _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    for (; k < len; ++k) out[k] = at::BFloat16(static_cast<float>(src[k]));
    std::fill(out + len, out + kKC, at::BFloat16(0.f));
  }
  void fetch(int64_t n, int64_t k0) const { fetch_bytes(w + n * K + k0, std::min<int64_t>(K - k0, kKC)); }
};

struct Int4Rows {
  const uint8_t* packed;
  const at::Half *scale, *low;
  int64_t K, Kp;
  void row(int64_t n, int64_t k0, at::BFloat16* out) const {
    float sc[kKC / int4::kGroup], lo[kKC / int4::kGroup];
    const int64_t len = std::clamp<int64_t>(K - k0, 0, kKC), groups = Kp / int4::kGroup;
    if (len > 0) {  // whole 64-column blocks of the chunk (Kp is a multiple of 64; KC too), by lookup (block_bf16)
      const int64_t span = std::min<int64_t>(kKC, Kp - k0);
      int4::row_params(scale + n * groups + k0 / int4::kGroup, low + n * groups + k0 / int4::kGroup,
                       span / int4::kGroup, sc, lo);
      for (int64_t b = 0; b < span / int4::kBlock; ++b)
        int4::block_bf16(packed + n * Kp / 2 + k0 / 2, b, sc, lo, out + b * int4::kBlock);
    }
    std::fill(out + len, out + kKC, at::BFloat16(0.f));  // past K (and past the blocks: the chunk's end)
  }
  void fetch(int64_t n, int64_t k0) const {
    fetch_bytes(packed + n * Kp / 2 + k0 / 2, std::min<int64_t>(Kp - k0, kKC) / 2);
    fetch_bytes(scale + n * Kp / int4::kGroup + k0 / int4::kGroup, kKC / int4::kGroup * 2);
    fetch_bytes(low + n * Kp / int4::kGroup + k0 / int4::kGroup, kKC / int4::kGroup * 2);
  }
};

struct Int8PanelPairs {
  const int32_t* panels;  // [P, K4, 16]
  int64_t P, K4;

  void fill(int64_t n0, int64_t k0, int32_t* panel) const {
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t q = 0; q < kKC / 4; ++q) {
        const int64_t p = n0 / 16 + h, j = k0 / 4 + q;
        __m512i pair0 = _mm512_setzero_si512(), pair1 = _mm512_setzero_si512();
        if (p < P && j < K4) int8_panels::entry_pairs(panels + (p * K4 + j) * 16, pair0, pair1);
        _mm512_storeu_si512(panel + 2 * q * kNR + 16 * h, pair0);
        _mm512_storeu_si512(panel + (2 * q + 1) * kNR + 16 * h, pair1);
      }
  }
  void fetch(int64_t n0, int64_t k0) const {  // two contiguous 2 KB runs
    for (int64_t h = 0; h < 2; ++h)
      if (n0 / 16 + h < P && k0 / 4 < K4)
        fetch_bytes(panels + ((n0 / 16 + h) * K4 + k0 / 4) * 16, std::min<int64_t>(K4 - k0 / 4, kKC / 4) * 64);
  }
};

}  // namespace pair_sources

#endif  // AVX512-BF16
