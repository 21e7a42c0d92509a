// Group-wise int4 weights (services/int4_weight.py): y = x @ W^T (+ bias) for decode (W dequantized whole for
// prefill: int4_dequantize.cpp).
//
// Legend: M rows of x, K input features, Kp = K padded to whole 64-column blocks, N output
// features, G = 32 columns per group, B = Kp / 64 blocks per row.
//   x:      [M, K]       float32 / bfloat16 / float16
//   packed: [N, Kp / 2]  uint8; block b of row n is 32 bytes; column e of the block is the low
//                        nibble of byte ORDER[e] (ORDER[e] < 32) or the high nibble of byte ORDER[e] - 32
//                        (ORDER: block_order in int4_block.h, BLOCK_ORDER in int4_weight.py)
//   scale:  [N, Kp / G]  float16;  low: [N, Kp / G] float16:  w[n, k] = q * scale[n, k/G] + low[n, k/G]
//   bias:   [N]          optional, x's dtype
//   y:      [M, N]       x's dtype, accumulated in float32
//
// Why the layout: with bf16 x on a CPU with AVX512-BF16, a block's 32 bytes loaded into both halves
// of a register, the upper half shifted right by 4 and masked, give 64 nibbles; interleaving their
// bytes with 0x43 (unpacklo/hi_epi8) makes 2 x 32 bf16 words 0x43qq = 128 + q, exactly: no table, no
// conversion. Then w = (128 + q) * scale + (low - 128 * scale), so a row is
// sum_g scale_g * dot(x_g, 128 + q_g) + sum_g (low_g - 128 scale_g) * sum(x_g). The words are ordered
// so that the even lanes of vdpbf16ps sum the block's first group and the odd lanes its second: two
// vdpbf16ps and one FMA (by the two scales, alternating) per 64 weights, plus one short dot per row;
// x is put in the same order once per call. Threads take N's rows in chunks (thread_chunks.h), each read as
// `streams` parts (x16_groups.h's x16_product: a row of each part together for one x row), prefetched into the
// caches or past them: one stream per thread left this kernel at 40 GB/s from memory on an AMD EPYC Zen 5 against
// 67 from the caches; 4 parts read 42-48 (docs/kernels.md). On AVX2 CPUs (the float32 loop below) `streams` changes
// nothing.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_block.h"
#include "int4_slot_x.h"
#include "x16_groups.h"
#include "thread_chunks.h"
#include "vec_load.h"

namespace {

using namespace int4;
constexpr int64_t kTile = 4;  // x rows per pass over W

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// acc[m * R + r] = dot(x[m, :Kp], W row r) for MT rows of x (bf16 in block_slot's order, zero past K) and R W rows
// `apart` rows from one to the next (R > 1 only with MT = 1), xsum [MT, Kp / G]: x's group sums. packed, sc, lo:
// the first row's bytes [Kp / 2] and group parameters [Kp / G] (float16, converted as they are read). Each row's
// arithmetic is the same for any R.
template <int MT, int R, int Locality>
void dot_rows(const at::BFloat16* x, int64_t Kp, const uint8_t* packed, const at::Half* sc, const at::Half* lo,
              const float* xsum, int64_t apart, float* acc) {
  static_assert(MT == 1 || R == 1, "several W rows at once for one x row only");
  constexpr int kChains = 4;  // accumulators per (x row, W row), for any R: the dot and FMA latencies hidden
  const int64_t blocks = Kp / kBlock, row_bytes = Kp / 2, groups = Kp / kGroup;
  __m512 vacc[MT][R][kChains];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < kChains; ++a) vacc[m][r][a] = _mm512_setzero_ps();
  // Block b into accumulator a (fixed at compile time: indexed at run time they live in memory). x is in
  // block_slot's order: per block, register 0's 32 words, then register 1's.
  auto block = [&](int64_t b, int a) __attribute__((always_inline)) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = packed + r * apart * row_bytes;
      if ((b & 1) == 0) __builtin_prefetch(row + b * 32 + kPrefetchBytes / R, 0, Locality);
      __m512i wa, wb;
      block_words(row, b, wa, wb);
      int32_t bits;  // the block's two group scales (float16), broadcast as a, b, a, b, ...
      std::memcpy(&bits, sc + r * apart * groups + 2 * b, sizeof bits);
      const __m512 s = _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))));
      for (int m = 0; m < MT; ++m) {
        const __m512bh xa = (__m512bh)_mm512_loadu_si512(x + m * Kp + b * kBlock);
        const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + m * Kp + b * kBlock + 32);
        const __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xa, (__m512bh)wa), xb, (__m512bh)wb);
        vacc[m][r][a] = _mm512_fmadd_ps(dot, s, vacc[m][r][a]);
      }
    }
  };
  int64_t b = 0;
  for (; b + kChains <= blocks; b += kChains)  // kChains blocks' chains in flight
    for (int a = 0; a < kChains; ++a) block(b + a, a);
  for (; b < blocks; ++b) block(b, 0);
  for (int r = 0; r < R; ++r) {
    const at::Half* rs = sc + r * apart * groups;
    const at::Half* rl = lo + r * apart * groups;
    for (int m = 0; m < MT; ++m) {
      __m512 sum = vacc[m][r][0];
      for (int a = 1; a < kChains; ++a) sum = _mm512_add_ps(sum, vacc[m][r][a]);
      int64_t g = 0;
      for (; g + 16 <= groups; g += 16) {  // the offsets low - 128 * scale, times the group sums of x
        const __m512 gs = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs + g)));
        const __m512 gl = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rl + g)));
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), gs, gl);
        sum = _mm512_fmadd_ps(offset, _mm512_loadu_ps(xsum + m * groups + g), sum);
      }
      float total = _mm512_reduce_add_ps(sum);
      for (; g < groups; ++g)
        total += (static_cast<float>(rl[g]) - 128.f * static_cast<float>(rs[g])) * xsum[m * groups + g];
      acc[m * R + r] = total;
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512BF16__) && defined(__AVX512BW__))
// The same product on AVX2 CPUs, in float32: x [*, Kp] in each block's byte order (x_p = x[e] where
// column e's nibble is at p = block_order(e): p < 32 low nibbles of bytes 0..31, then the high ones), so
// the nibbles need no shuffle back: q as float32 8 at a time, q . x per lane, then one FMA by the lanes'
// group scales (lane l of every 8 bytes is in group bit 1 of l, see block_slot), and the offsets as one
// short dot with the group sums of x. acc[m] = dot(x[m], W row) for MT rows of x.
template <int MT>
void dot_row_float(const float* x, int64_t Kp, const uint8_t* packed, const float* sc, const float* lo,
                   const float* xsum, float* acc) {
  __m256 vacc[MT][2];
  for (int m = 0; m < MT; ++m) vacc[m][0] = vacc[m][1] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  auto block = [&](int64_t b, int a) __attribute__((always_inline)) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + b * 32));
    const __m256i nibbles[2] = {_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask)};
    __m256 q[8];  // bytes 8u .. 8u + 7 of the 64 nibbles, as float32
    for (int h = 0; h < 2; ++h)
      for (int lane = 0; lane < 2; ++lane) {
        const __m128i bytes = lane ? _mm256_extracti128_si256(nibbles[h], 1) : _mm256_castsi256_si128(nibbles[h]);
        q[4 * h + 2 * lane] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        q[4 * h + 2 * lane + 1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
      }
    double pair;  // the block's two group scales: a b a b ... -> a a b b a a b b
    std::memcpy(&pair, sc + 2 * b, sizeof pair);
    const __m256 s = _mm256_permute_ps(_mm256_castpd_ps(_mm256_set1_pd(pair)), 0x50);
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * Kp + b * kBlock;
      __m256 t[4];  // four chains, not one: eight dependent FMAs would leave the block latency-bound
      for (int u = 0; u < 4; ++u) t[u] = _mm256_mul_ps(q[u], _mm256_loadu_ps(xb + 8 * u));
      for (int u = 4; u < 8; ++u) t[u - 4] = _mm256_fmadd_ps(q[u], _mm256_loadu_ps(xb + 8 * u), t[u - 4]);
      const __m256 dot = _mm256_add_ps(_mm256_add_ps(t[0], t[1]), _mm256_add_ps(t[2], t[3]));
      vacc[m][a] = _mm256_fmadd_ps(dot, s, vacc[m][a]);
    }
  };
  const int64_t blocks = Kp / kBlock;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // two blocks' chains in flight
    block(b, 0);
    block(b + 1, 1);
  }
  if (b < blocks) block(b, 0);
  const int64_t groups = Kp / kGroup;
  for (int m = 0; m < MT; ++m) {
    float total = sum8(_mm256_add_ps(vacc[m][0], vacc[m][1]));
    for (int64_t g = 0; g < groups; ++g) total += lo[g] * xsum[m * groups + g];
    acc[m] = total;
  }
}

struct FloatBlocks {  // for product(): float32 x in block_order's byte order
  template <int MT>
  static void row(const float* x, int64_t Kp, const uint8_t* packed, const float* sc, const float* lo,
                  const float* xsum, float* acc) {
    dot_row_float<MT>(x, Kp, packed, sc, lo, xsum, acc);
  }
};
#endif

// A column order as an index tensor over its own storage (made once; a fresh tensor per call cost a few us
// of a call's ~15 us of fixed cost).
inline torch::Tensor order_tensor(std::vector<int64_t>& order) {
  return torch::from_blob(order.data(), {static_cast<int64_t>(order.size())}, torch::kLong);
}

// y [M, N] float32 = x [M, Kp] @ W^T through Blocks::row<MT> (MT <= kTile rows of x, in the order Blocks reads,
// against one W row, given its group parameters as float32 and x's group sums xsum [M, Kp / G]). Threads take N's rows
// in chunks (thread_chunks.h).
template <typename Blocks, typename X>
void product(const X* x, const float* xsum, int64_t M, int64_t Kp, const uint8_t* packed, const at::Half* scale,
             const at::Half* low, float* y, int64_t N) {
  const int64_t groups = Kp / kGroup;
  parallel_chunks(N, [&](int64_t n0, int64_t n1) {
    std::vector<float> sc(groups), lo(groups);
    float acc[kTile];
    for (int64_t m = 0; m < M; m += kTile) {
      const int64_t mt = std::min(kTile, M - m);
      const X* xm = x + m * Kp;
      const float* sm = xsum + m * groups;
      for (int64_t n = n0; n < n1; ++n) {
        row_params(scale + n * groups, low + n * groups, groups, sc.data(), lo.data());
        const uint8_t* row = packed + n * Kp / 2;
        switch (mt) {
          case 1: Blocks::template row<1>(xm, Kp, row, sc.data(), lo.data(), sm, acc); break;
          case 2: Blocks::template row<2>(xm, Kp, row, sc.data(), lo.data(), sm, acc); break;
          case 3: Blocks::template row<3>(xm, Kp, row, sc.data(), lo.data(), sm, acc); break;
          default: Blocks::template row<4>(xm, Kp, row, sc.data(), lo.data(), sm, acc); break;
        }
        for (int64_t i = 0; i < mt; ++i) y[(m + i) * N + n] = acc[i];
      }
    }
  });
}

}  // namespace

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low, const c10::optional<torch::Tensor>& bias, int64_t streams,
                          bool non_temporal) {
  const Int4Args w = check_product(x, packed, scale, low);
  TORCH_CHECK(streams >= 1 && streams <= 4, "streams must be 1 to 4, got ", streams);  // on every path alike
  const int64_t M = x.size(0), K = x.size(1), N = w.N, Kp = w.Kp, groups = w.groups;
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* lo = low.data_ptr<at::Half>();
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) {
    const SlotX xp = slot_x(x, Kp);
    const at::BFloat16* xv = xp.x.data();
    const float* xs = xp.xsum.data();
    return with_prefetch_locality(non_temporal, [&](auto locality) {
      auto rows = [&](auto tile, auto parts, int64_t m, int64_t n, int64_t apart, float* acc) {
        dot_rows<decltype(tile)::value, decltype(parts)::value, decltype(locality)::value>(
            xv + m * Kp, Kp, q + n * Kp / 2, s + n * groups, lo + n * groups, xs + m * groups, apart, acc);
      };
      return x16_product(x, N, bias, streams, rows);
    });
  }
#endif
  // float32 sums, rounded once to x's dtype below (the AVX512-BF16 path above writes its own y)
  torch::Tensor y32 = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* y = y32.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512BF16__) && defined(__AVX512BW__))
  // 16-bit x (a float32 model keeps the dequantize-then-dot below: the same sums as torch's dequantized product)
  if (x.scalar_type() != at::kFloat) {
    torch::Tensor xp = padded_x(x, Kp).to(at::kFloat);  // [M, Kp]
    torch::Tensor xsum = xp.view({M, groups, kGroup}).sum(2).contiguous();  // [M, Kp / G]
    static std::vector<int64_t> order = [] {  // byte position -> column
      std::vector<int64_t> o(kBlock);
      for (int e = 0; e < kBlock; ++e) o[block_order(e)] = e;
      return o;
    }();
    xp = xp.view({M, Kp / kBlock, kBlock}).index_select(2, order_tensor(order)).contiguous();  // [M, Kp / 64, 64]
    product<FloatBlocks>(xp.data_ptr<float>(), xsum.data_ptr<float>(), M, Kp, q, s, lo, y, N);
    if (bias.has_value()) y32.add_(bias->to(at::kFloat));
    return y32.to(x.scalar_type());
  }
#endif
  // Any other case: each W row dequantized to float32 once, then dotted with every x row.
  torch::Tensor x32 = x.to(at::kFloat).contiguous();
  const float* xv = x32.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    std::vector<float> sc(groups), lw(groups), row(Kp);
    for (int64_t n = n0; n < n1; ++n) {
      row_params(s + n * groups, lo + n * groups, groups, sc.data(), lw.data());
      dequantize_row(q + n * Kp / 2, sc.data(), lw.data(), Kp, row.data());
      for (int64_t m = 0; m < M; ++m) {
        float part[16] = {0};  // 16 partial sums: the compiler vectorizes the loop
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
          for (int i = 0; i < 16; ++i) part[i] += xv[m * K + k + i] * row[k + i];
        float total = 0.f;
        for (; k < K; ++k) total += xv[m * K + k] * row[k];
        for (int i = 0; i < 16; ++i) total += part[i];
        y[m * N + n] = total;
      }
    }
  });
  if (bias.has_value()) y32.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y32 : y32.to(x.scalar_type());
}
