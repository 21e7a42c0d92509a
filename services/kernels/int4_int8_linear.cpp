// Group-wise int4 weights times x rounded to int8 per group, for decode on CPUs whose float32
// arithmetic cannot keep up with int4's bytes (AVX2 without AVX-512 BF16: Zen 1-3, Intel client cores).
//
// Legend: M rows of x, K input features, Kp = K padded to whole 64-column blocks, N output
// features, G = 32 columns per group, B = Kp / 64 blocks per row, groups = Kp / G.
//   x:      [M, K]       float32 / bfloat16 / float16
//   packed, scale, low:  as in int4_block.h (w[n, k] = q * scale[n, k/G] + low[n, k/G], q in 0..15)
//   bias:   [N]          optional, x's dtype
//   y:      [M, N]       x's dtype, accumulated in float32
//
// What it computes: each group of 32 columns of each x row rounded to int8 with its own scale
// (largest magnitude -> 127, round half to even: xq = rint(x * 127 / amax), sx = amax / 127), then
//   y[m, n] = sum_g scale[n, g] * sx[m, g] * (q_g . xq_g)  +  sum_g low[n, g] * sum(x[m, g])
// — the scaled term on int8 x (llama.cpp's Q4_0 x Q8_0 does the same), the offsets on x as it is.
// Why: the nibble . x products become integer multiply-adds, 32 per instruction (vpmaddubsw: u8 q x
// s8 xq, pairs summed into int16 with no overflow: 2 * 15 * 127 < 32767), where float32 needs a
// conversion and an FMA per 8 weights (AMD EPYC Zen 3: 2.1 ms for a 16384 x 2048 product against
// int4's 0.5 ms of memory traffic).
//
// The layout: a block's 32 bytes hold columns in int4_block.h's block_order (byte p: its low nibble is
// one column, its high nibble another; bit 1 of p says the group). One vpshufb per block sorts each
// 16-byte lane into [8 bytes of group a, 8 of group b], then low and high nibbles are two u8 vectors
// whose int32 pair sums (vpmaddubsw, vpmaddwd by ones) are in groups a a b b a a b b; xq is stored in
// that same order per block (low nibbles' 32, then high nibbles' 32), with its scales as 8 floats per
// block in the lanes' pattern. Threads split N.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_block.h"
#include "vec_load.h"

// Without AVX2, FMA and F16C there is no such kernel (bindings.cpp leaves the name out; the plan never offers it).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

using namespace int4;
constexpr int64_t kTile = 4;  // x rows per pass over W

// Sorts each 16-byte lane into [group a's 8 bytes, group b's 8 bytes] (bit 1 of a byte's position is its group).
constexpr int kSort[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};

// The column of a block (0..63) that kernel slot s holds: s < 32 low nibbles, s >= 32 high nibbles, each
// half in sorted byte order.
std::vector<int> slot_columns() {
  std::vector<int> byte_column(kBlock);  // byte position (0..63 as in block_order) -> column
  for (int e = 0; e < kBlock; ++e) byte_column[block_order(e)] = e;
  std::vector<int> columns(kBlock);
  for (int s = 0; s < kBlock; ++s) {
    const int half = s / 32, within = s % 32, lane = within / 16;
    columns[s] = byte_column[32 * half + 16 * lane + kSort[within % 16]];
  }
  return columns;
}

// x rounded per group: xq [M, Kp] int8 in slot order, xscale [M, B, 8] in the lanes' group pattern
// (a a b b a a b b), xsum [M, groups] the sums of x itself (for the offsets).
struct RoundedX {
  std::vector<int8_t> xq;
  std::vector<float> xscale, xsum;
};

RoundedX round_x(const torch::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1), blocks = Kp / kBlock, groups = Kp / kGroup;
  torch::Tensor x32 = x.to(at::kFloat).contiguous();
  const float* xv = x32.data_ptr<float>();
  static const std::vector<int> columns = slot_columns();
  RoundedX r{std::vector<int8_t>(M * Kp), std::vector<float>(M * blocks * 8), std::vector<float>(M * groups)};
  std::vector<int8_t> q(Kp);  // one row in column order
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xv + m * K;
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0.f, sum = 0.f;
      for (int64_t k = g * kGroup; k < std::min((g + 1) * kGroup, K); ++k) {
        amax = std::max(amax, std::fabs(row[k]));
        sum += row[k];
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
        q[k] = k < K ? static_cast<int8_t>(std::nearbyint(row[k] * inv)) : 0;
      r.xsum[m * groups + g] = sum;
      const float sx = amax / 127.f;
      for (int l = 0; l < 8; ++l)  // lanes a a b b a a b b of block g / 2
        if (((l >> 1) & 1) == g % 2) r.xscale[(m * blocks + g / 2) * 8 + l] = sx;
    }
    for (int64_t b = 0; b < blocks; ++b)
      for (int s = 0; s < kBlock; ++s) r.xq[m * Kp + b * kBlock + s] = q[b * kBlock + columns[s]];
  }
  return r;
}

// acc[m] = sum_b (lanes of) scale pattern * xscale * (q . xq) for MT rows of x against one W row; the offsets
// are added by the caller. sc: the row's group scales [groups], read as float16 pairs (two per block).
template <int MT>
void dot_row(const int8_t* xq, const float* xscale, int64_t Kp, const uint8_t* packed, const at::Half* sc, float* acc) {
  const int64_t blocks = Kp / kBlock;
  const __m256i sort = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 vacc[MT][2];
  for (int m = 0; m < MT; ++m) vacc[m][0] = vacc[m][1] = _mm256_setzero_ps();
  auto block = [&](int64_t b, int a) __attribute__((always_inline)) {
    // the row two ahead (rows are Kp / 2 bytes), a cache line per two blocks: the hardware prefetcher alone
    // left a 16384 x 2048 product at 28 GB/s, this at 34 (Zen 3; the read ceiling is 38). Past the last row
    // a prefetch is a hint: it never faults
    if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(packed + Kp + b * 32), _MM_HINT_T0);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + b * 32));
    const __m256i raw = _mm256_shuffle_epi8(bytes, sort);
    const __m256i low = _mm256_and_si256(raw, mask), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    int32_t bits;  // the block's two group scales a, b -> a a b b a a b b
    std::memcpy(&bits, sc + 2 * b, sizeof bits);
    const __m128 p = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    const __m256 s = _mm256_permute_ps(_mm256_set_m128(p, p), 0x50);
    for (int m = 0; m < MT; ++m) {
      const int8_t* xb = xq + m * Kp + b * kBlock;
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32));
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, xl), _mm256_maddubs_epi16(high, xh));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));  // [8] int32 sums of 8 products each
      const __m256 both = _mm256_mul_ps(s, _mm256_loadu_ps(xscale + (m * blocks + b) * 8));
      vacc[m][a] = _mm256_fmadd_ps(dot, both, vacc[m][a]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // two blocks' chains in flight
    block(b, 0);
    block(b + 1, 1);
  }
  if (b < blocks) block(b, 0);
  for (int m = 0; m < MT; ++m) acc[m] = sum8(_mm256_add_ps(vacc[m][0], vacc[m][1]));
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

torch::Tensor int4_int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                               const torch::Tensor& low, const c10::optional<torch::Tensor>& bias) {
  const Int4Args w = check_product(x, packed, scale, low);
  const int64_t M = x.size(0), N = w.N, Kp = w.Kp, groups = w.groups;
  const RoundedX r = round_x(x, Kp);
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* lo = low.data_ptr<at::Half>();
  torch::Tensor y32 = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* y = y32.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    float acc[kTile];
    for (int64_t m = 0; m < M; m += kTile) {
      const int64_t mt = std::min(kTile, M - m);
      const int8_t* xm = r.xq.data() + m * Kp;
      const float* xs = r.xscale.data() + m * (Kp / kBlock) * 8;
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = q + n * Kp / 2;
        switch (mt) {
          case 1: dot_row<1>(xm, xs, Kp, row, s + n * groups, acc); break;
          case 2: dot_row<2>(xm, xs, Kp, row, s + n * groups, acc); break;
          case 3: dot_row<3>(xm, xs, Kp, row, s + n * groups, acc); break;
          default: dot_row<4>(xm, xs, Kp, row, s + n * groups, acc); break;
        }
        for (int64_t i = 0; i < mt; ++i)
          y[(m + i) * N + n] = acc[i] + offsets(lo + n * groups, r.xsum.data() + (m + i) * groups, groups);
      }
    }
  });
  if (bias.has_value()) y32.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y32 : y32.to(x.scalar_type());
}

#endif  // AVX2, FMA, F16C
