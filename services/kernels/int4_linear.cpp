// Group-wise int4 weights (services/int4_weight.py): y = x @ W^T (+ bias) for decode, and W itself
// dequantized for prefill's dense product.
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
// x is put in the same order once per call. Threads split N.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_block.h"
#include "vec_load.h"

namespace {

using namespace int4;
constexpr int64_t kTile = 4;  // x rows per pass over W

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// acc[m] = dot(x[m, :Kp], W row) for MT rows of x (bf16, zero past K), xsum[m]: [Kp / G] group sums.
template <int MT>
void dot_row(const at::BFloat16* x, int64_t Kp, const uint8_t* packed, const float* sc, const float* lo,
             const float* xsum, float* acc) {
  __m512 vacc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < 4; ++a) vacc[m][a] = _mm512_setzero_ps();
  // Block b into accumulator a (fixed at compile time: indexed at run time they live in memory). x is in
  // block_slot's order: per block, register 0's 32 words, then register 1's.
  auto block = [&](int64_t b, int a) __attribute__((always_inline)) {
    __m512i wa, wb;
    block_words(packed, b, wa, wb);
    double pair;  // the block's two group scales, broadcast as a, b, a, b, ...
    std::memcpy(&pair, sc + 2 * b, sizeof pair);
    const __m512 s = _mm512_castpd_ps(_mm512_set1_pd(pair));
    for (int m = 0; m < MT; ++m) {
      const __m512bh xa = (__m512bh)_mm512_loadu_si512(x + m * Kp + b * kBlock);
      const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + m * Kp + b * kBlock + 32);
      const __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xa, (__m512bh)wa), xb, (__m512bh)wb);
      vacc[m][a] = _mm512_fmadd_ps(dot, s, vacc[m][a]);
    }
  };
  const int64_t blocks = Kp / kBlock;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {  // four blocks' chains in flight: the dot and FMA latencies are hidden
    block(b, 0);
    block(b + 1, 1);
    block(b + 2, 2);
    block(b + 3, 3);
  }
  for (; b < blocks; ++b) block(b, 0);
  const int64_t groups = Kp / kGroup;
  for (int m = 0; m < MT; ++m) {
    __m512 sum = _mm512_add_ps(_mm512_add_ps(vacc[m][0], vacc[m][1]), _mm512_add_ps(vacc[m][2], vacc[m][3]));
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) {  // the offsets low - 128 * scale, times the group sums of x
      const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), _mm512_loadu_ps(sc + g), _mm512_loadu_ps(lo + g));
      sum = _mm512_fmadd_ps(off, _mm512_loadu_ps(xsum + m * groups + g), sum);
    }
    float total = _mm512_reduce_add_ps(sum);
    for (; g < groups; ++g) total += (lo[g] - 128.f * sc[g]) * xsum[m * groups + g];
    acc[m] = total;
  }
}

struct Bf16Blocks {  // for product(): bf16 x in block_slot's order
  template <int MT>
  static void row(const at::BFloat16* x, int64_t Kp, const uint8_t* packed, const float* sc, const float* lo,
                  const float* xsum, float* acc) {
    dot_row<MT>(x, Kp, packed, sc, lo, xsum, acc);
  }
};
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
// against one W row, given its group parameters as float32 and x's group sums xsum [M, Kp / G]). Threads split N.
template <typename Blocks, typename X>
void product(const X* x, const float* xsum, int64_t M, int64_t Kp, const uint8_t* packed, const at::Half* scale,
             const at::Half* low, float* y, int64_t N) {
  const int64_t groups = Kp / kGroup;
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
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
                          const torch::Tensor& low, const c10::optional<torch::Tensor>& bias) {
  const Int4Args w = check_product(x, packed, scale, low);
  const int64_t M = x.size(0), K = x.size(1), N = w.N, Kp = w.Kp, groups = w.groups;
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* lo = low.data_ptr<at::Half>();
  torch::Tensor y32 = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* y = y32.data_ptr<float>();
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) {
    torch::Tensor xp = padded_x(x, Kp);  // [M, Kp]
    torch::Tensor xsum = xp.view({M, groups, kGroup}).to(at::kFloat).sum(2).contiguous();  // [M, Kp / G]
    static std::vector<int64_t> order = [] {  // slot -> column: x in the order of the weights' bf16 words
      std::vector<int64_t> o(kBlock);
      for (int e = 0; e < kBlock; ++e) {
        int r, w;
        block_slot(e, r, w);
        o[32 * r + w] = e;
      }
      return o;
    }();
    xp = xp.view({M, Kp / kBlock, kBlock}).index_select(2, order_tensor(order)).contiguous();  // [M, Kp / 64, 64]
    product<Bf16Blocks>(xp.data_ptr<at::BFloat16>(), xsum.data_ptr<float>(), M, Kp, q, s, lo, y, N);
    if (bias.has_value()) y32.add_(bias->to(at::kFloat));
    return y32.to(x.scalar_type());
  }
#endif
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

torch::Tensor int4_dequantize(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low,
                              torch::Tensor out) {
  // -> out [N, in_features] (float32 / bfloat16 / float16), for a dense product over many rows (prefill).
  // The caller's buffer, reused: a fresh 64 MB result is a fresh mapping whose pages fault in (dequant_buffer.py)
  const Int4Args w = check(packed, scale, low);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.device().is_cpu() && out.size(0) == w.N,
              "out must be a contiguous CPU [N, in_features] tensor");
  const int64_t in_features = out.size(1);
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(in_features <= w.Kp && in_features > w.Kp - kBlock, "in_features must lie in the last 64-column block");
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* lo = low.data_ptr<at::Half>();
  auto run = [&](auto* o) {
    at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
      std::vector<float> sc(w.groups), lw(w.groups), row(w.Kp);
      for (int64_t n = n0; n < n1; ++n) {
        row_params(s + n * w.groups, lo + n * w.groups, w.groups, sc.data(), lw.data());
        dequantize_row(q + n * w.Kp / 2, sc.data(), lw.data(), w.Kp, row.data());
        store_row(row.data(), o + n * in_features, in_features);
      }
    });
  };
  switch (dtype) {
    case at::kFloat: run(out.data_ptr<float>()); break;
    case at::kBFloat16: run(out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(out.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "int4 dequantizes to float32, bfloat16 or float16, not ", dtype);
  }
  return out;
}
