// Group-wise int4 weights times x held as int16 per group, for decode on CPUs whose float32 arithmetic
// cannot keep up with int4's bytes (AVX2 without AVX-512 BF16: Zen 1-3, Intel client cores).
//
// Legend: M rows of x, K input features, Kp = K padded to whole 64-column blocks, N output
// features, G = 32 columns per group, B = Kp / 64 blocks per row, groups = Kp / G.
//   x:      [M, K]       float32 / bfloat16 / float16
//   packed, scale, low:  as in int4_block.h (w[n, k] = q * scale[n, k/G] + low[n, k/G], q in 0..15)
//   bias:   [N]          optional, x's dtype
//   y:      [M, N]       x's dtype, accumulated in float32
//
// What it computes: x as x16_groups.h makes it (xq int16, xscale per group), then
//   y[m, n] = sum_g scale[n, g] * xscale[m, g] * (q_g . xq_g)  +  sum_g low[n, g] * sum(x[m, g])
// Why: the nibble . x products become integer multiply-adds, 16 per instruction (vpmaddwd, q and xq
// as int16, pairs summed into int32), where float32 needs a conversion and an FMA per 8 weights (AMD
// EPYC Zen 3: 2.1 ms for a 16384 x 2048 product against int4's 0.5 ms of memory traffic).
//
// The layout: a block's 32 bytes hold columns in int4_block.h's block_order (byte p: its low nibble is
// one column, its high nibble another; bit 1 of p says the group, so byte pairs share one). Low and
// high nibbles, each widened to int16 by unpacking with zero (lo / hi 8 bytes of each 128-bit lane),
// make four vectors of 16; vpmaddwd's int32 pair sums then alternate groups a b a b, and the four
// vectors' sums are added before one conversion and one FMA by [scale_a * xscale_a, scale_b * xscale_b,
// ...]. xq is stored in the four vectors' order per block, with its scales as 8 floats per block in the
// lanes' pattern. Threads take N's rows in chunks (thread_chunks.h).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_block.h"
#include "x16_groups.h"
#include "vec_load.h"

// Without AVX2, FMA and F16C there is no such kernel (bindings.cpp leaves the name out; the plan never offers it).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

using namespace int4;

// The column of a block (0..63) that kernel slot s holds: slot 16v + 8L + i is int16 lane i of 128-bit lane L
// of vector v = 2 * nibble + unpack (nibble: 0 low, 1 high; unpack: 0 lo, 1 hi), i.e. byte 16L + 8 unpack + i.
std::vector<int> slot_columns() {
  std::vector<int> byte_column(kBlock);  // nibble position (0..63 as in block_order) -> column
  for (int e = 0; e < kBlock; ++e) byte_column[block_order(e)] = e;
  std::vector<int> columns(kBlock);
  for (int s = 0; s < kBlock; ++s) {
    const int v = s / 16, lane = (s % 16) / 8, i = s % 8;
    columns[s] = byte_column[32 * (v / 2) + 16 * lane + 8 * (v % 2) + i];
  }
  return columns;
}

// xscale [M, groups] spread into the lanes' group pattern of each block: [M, B, 8] = a b a b a b a b.
std::vector<float> lane_scales(const std::vector<float>& xscale, int64_t M, int64_t blocks) {
  std::vector<float> lanes(M * blocks * 8);
  for (int64_t i = 0; i < M * blocks; ++i)
    for (int l = 0; l < 8; ++l) lanes[i * 8 + l] = xscale[2 * i + (l & 1)];
  return lanes;
}

// acc[m * R + r] = sum_b (lanes of) scale pattern * xscale * (q . xq) for MT rows of x against R W rows, `apart`
// rows from one to the next (R > 1 only with MT = 1: the registers hold MT x R x 2 accumulators); the offsets are
// added by the caller. packed, sc: the first row's bytes [Kp / 2] and group scales [groups], read as float16 pairs
// (two per block). Each row's arithmetic is the same for any R.
template <int MT, int R, int Locality>
void dot_rows(const int16_t* xq, const float* xscale, int64_t Kp, const uint8_t* packed, const at::Half* sc,
              int64_t apart, float* acc) {
  static_assert(MT == 1 || R == 1, "several W rows at once for one x row only");
  const int64_t blocks = Kp / kBlock, row_bytes = Kp / 2, groups = Kp / kGroup;
  const __m256i mask = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  __m256 vacc[MT][R][2];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) vacc[m][r][0] = vacc[m][r][1] = _mm256_setzero_ps();
  auto block = [&](int64_t b, int a) __attribute__((always_inline)) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = packed + r * apart * row_bytes + b * 32;
      // a cache line per two blocks, kPrefetchBytes ahead in all (x16_groups.h: each of R streams a 1 / R of
      // it), into the caches or past them (Locality 0)
      if ((b & 1) == 0) __builtin_prefetch(row + kPrefetchBytes / R, 0, Locality);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      const __m256i low = _mm256_and_si256(raw, mask), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      const __m256i q[4] = {_mm256_unpacklo_epi8(low, zero), _mm256_unpackhi_epi8(low, zero),
                            _mm256_unpacklo_epi8(high, zero), _mm256_unpackhi_epi8(high, zero)};
      int32_t bits;  // the block's two group scales (float16), broadcast as a b a b ...
      std::memcpy(&bits, sc + r * apart * groups + 2 * b, sizeof bits);
      const __m128 pair = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
      const __m256 s = _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(pair)));
      for (int m = 0; m < MT; ++m) {
        const __m256i* xb = reinterpret_cast<const __m256i*>(xq + m * Kp + b * kBlock);
        __m256i dot = _mm256_madd_epi16(q[0], _mm256_loadu_si256(xb));  // [8] int32, groups a b a b ...
        for (int v = 1; v < 4; ++v) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(q[v], _mm256_loadu_si256(xb + v)));
        const __m256 both = _mm256_mul_ps(s, _mm256_loadu_ps(xscale + (m * blocks + b) * 8));
        vacc[m][r][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), both, vacc[m][r][a]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // two blocks' chains in flight
    block(b, 0);
    block(b + 1, 1);
  }
  if (b < blocks) block(b, 0);
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m * R + r] = sum8(_mm256_add_ps(vacc[m][r][0], vacc[m][r][1]));
}

// sum_g lo[g] * xsum[g]: one row's offsets (float16 [groups]) against one x row.
float offsets(const at::Half* lo, const float* xsum, int64_t groups) {
  __m256 sum = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + g)));
    sum = _mm256_fmadd_ps(low, _mm256_loadu_ps(xsum + g), sum);
  }
  float total = sum8(sum);
  for (; g < groups; ++g) total += static_cast<float>(lo[g]) * xsum[g];
  return total;
}

}  // namespace

torch::Tensor int4_x16_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                               const torch::Tensor& low, const c10::optional<torch::Tensor>& bias, int64_t streams,
                               bool non_temporal) {
  const Int4Args w = check_product(x, packed, scale, low);
  const int64_t M = x.size(0), N = w.N, Kp = w.Kp, groups = w.groups;
  static const std::vector<int> columns = slot_columns();
  const X16Groups r = x16_groups(x, Kp, &columns);
  const std::vector<float> xlanes = lane_scales(r.xscale, M, Kp / kBlock);
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* lo = low.data_ptr<at::Half>();
  return with_prefetch_locality(non_temporal, [&](auto locality) {
    auto rows = [&](auto tile, auto parts, int64_t m, int64_t n, int64_t apart, float* acc) {
      constexpr int MT = decltype(tile)::value, R = decltype(parts)::value;
      dot_rows<MT, R, decltype(locality)::value>(r.xq.data() + m * Kp, xlanes.data() + m * (Kp / kBlock) * 8, Kp,
                                                 q + n * Kp / 2, s + n * groups, apart, acc);
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < R; ++j)
          acc[i * R + j] += offsets(lo + (n + j * apart) * groups, r.xsum.data() + (m + i) * groups, groups);
    };
    return x16_product(x, N, bias, streams, rows);
  });
}

#endif  // AVX2, FMA, F16C
