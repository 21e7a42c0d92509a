// Group-wise int4 weights (services/int4_weight.py): y = x @ W^T (+ bias) for decode, and W itself
// dequantized for prefill's dense product.
//
// Legend: M rows of x, K input features, Kp = K padded to whole 64-column blocks, N output
// features, G = 32 columns per group, B = Kp / 64 blocks per row.
//   x:      [M, K]       float32 / bfloat16 / float16
//   packed: [N, Kp / 2]  uint8; block b of row n is 32 bytes; column e of the block is the low
//                        nibble of byte ORDER[e] (ORDER[e] < 32) or the high nibble of byte ORDER[e] - 32
//   scale:  [N, Kp / G]  float16;  low: [N, Kp / G] float16:  w[n, k] = q * scale[n, k/G] + low[n, k/G]
//   bias:   [N]          optional, x's dtype
//   y:      [M, N]       x's dtype, accumulated in float32
//
// Why the layout: with bf16 x on a CPU with AVX512-BF16, a block's 32 bytes loaded into both halves
// of a register, the upper half shifted right by 4 and masked, give 64 nibbles; interleaving their
// bytes with 0x43 (unpacklo/hi_epi8) makes 2 x 32 bf16 words 0x43qq = 128 + q, exactly, already
// in column order: no table, no conversion. Then w = (128 + q) * scale + (low - 128 * scale), so
// a row is sum_g scale_g * dot(x_g, 128 + q_g) + sum_g (low_g - 128 scale_g) * sum(x_g): one
// vdpbf16ps and one FMA per group, plus one short dot per row. Threads split N.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32, kBlock = 64, kTile = 4;  // kTile: x rows per pass over W

inline int block_order(int e) { return 16 * ((e % 32) / 8) + e % 8 + (e >= 32 ? 8 : 0); }

// One row's group parameters as float32 ([Kp / G] each).
inline void row_params(const at::Half* scale, const at::Half* low, int64_t groups, float* sc, float* lo) {
  int64_t g = 0;
#if defined(__AVX512F__)
  for (; g + 16 <= groups; g += 16) {  // 16 at a time: a scalar half conversion costs more than a block's dot
    _mm512_storeu_ps(sc + g, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g))));
    _mm512_storeu_ps(lo + g, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + g))));
  }
#endif
  for (; g < groups; ++g) {
    sc[g] = static_cast<float>(scale[g]);
    lo[g] = static_cast<float>(low[g]);
  }
}

#if defined(__AVX512BW__)
// Block b's 64 columns as two registers of 32 bf16 words 0x43qq = 128 + q, in column order.
inline void block_words(const uint8_t* packed, int64_t b, __m512i& wa, __m512i& wb) {
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + b * 32)));
  const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi16(raw, shifts), _mm512_set1_epi8(0x0F));
  wa = _mm512_unpacklo_epi8(nibbles, _mm512_set1_epi8(0x43));  // columns 64b .. 64b + 31
  wb = _mm512_unpackhi_epi8(nibbles, _mm512_set1_epi8(0x43));  // columns 64b + 32 .. 64b + 63
}
#endif

// One row of W as float32 (out: [Kp]), in column order.
void dequantize_row(const uint8_t* packed, const float* sc, const float* lo, int64_t Kp, float* out) {
#if defined(__AVX512BW__)
  for (int64_t b = 0; b < Kp / kBlock; ++b) {
    __m512i words[2];
    block_words(packed, b, words[0], words[1]);
    for (int h = 0; h < 4; ++h) {  // 16 columns at a time: bf16 -> float32 is a shift; q = that - 128
      const __m256i part = _mm512_extracti64x4_epi64(words[h / 2], 0);
      const __m256i part_hi = _mm512_extracti64x4_epi64(words[h / 2], 1);
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h % 2 ? part_hi : part), 16));
      const int64_t g = (b * kBlock + 16 * h) / kGroup;
      const __m512 q = _mm512_sub_ps(v, _mm512_set1_ps(128.f));
      _mm512_storeu_ps(out + b * kBlock + 16 * h, _mm512_fmadd_ps(q, _mm512_set1_ps(sc[g]), _mm512_set1_ps(lo[g])));
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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// acc[m] = dot(x[m, :Kp], W row) for MT rows of x (bf16, zero past K), xsum[m]: [Kp / G] group sums.
template <int MT>
void dot_row(const at::BFloat16* x, int64_t Kp, const uint8_t* packed, const float* sc, const float* lo,
             const float* xsum, float* acc) {
  __m512 vacc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < 4; ++a) vacc[m][a] = _mm512_setzero_ps();
  // Block b into accumulators a, a + 1 (a fixed at compile time: indexed at run time they live in memory).
  auto block = [&](int64_t b, int a) __attribute__((always_inline)) {
    __m512i wa, wb;
    block_words(packed, b, wa, wb);
    const __m512 sa = _mm512_set1_ps(sc[2 * b]), sb = _mm512_set1_ps(sc[2 * b + 1]);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xa = (__m512bh)_mm512_loadu_si512(x + m * Kp + b * kBlock);
      const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + m * Kp + b * kBlock + 32);
      vacc[m][a] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xa, (__m512bh)wa), sa, vacc[m][a]);
      vacc[m][a + 1] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xb, (__m512bh)wb), sb, vacc[m][a + 1]);
    }
  };
  const int64_t blocks = Kp / kBlock;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // two blocks' chains in flight: the FMA latency is hidden
    block(b, 0);
    block(b + 1, 2);
  }
  if (b < blocks) block(b, 0);
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

template <int MT>
void bf16_rows(const at::BFloat16* x, const float* xsum, int64_t Kp, const uint8_t* packed, const at::Half* scale,
               const at::Half* low, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t groups = Kp / kGroup;
  std::vector<float> sc(groups), lo(groups);
  float acc[kTile];
  for (int64_t n = n0; n < n1; ++n) {
    row_params(scale + n * groups, low + n * groups, groups, sc.data(), lo.data());
    dot_row<MT>(x, Kp, packed + n * Kp / 2, sc.data(), lo.data(), xsum, acc);
    for (int m = 0; m < MT; ++m) y[m * N + n] = acc[m];
  }
}
#endif

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

Int4Args check(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low) {
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

}  // namespace

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low, const c10::optional<torch::Tensor>& bias) {
  const Int4Args w = check(packed, scale, low);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) <= w.Kp && x.size(1) > w.Kp - kBlock,
              "x [M, K] expected with K within the weight's last 64-column block");
  const int64_t M = x.size(0), K = x.size(1), N = w.N, Kp = w.Kp, groups = w.groups;
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* lo = low.data_ptr<at::Half>();
  torch::Tensor y32 = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* y = y32.data_ptr<float>();
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) {
    torch::Tensor xp = torch::zeros({M, Kp}, x.options());  // [M, Kp], zero past K
    xp.narrow(1, 0, K).copy_(x);
    torch::Tensor xsum = xp.view({M, groups, kGroup}).to(at::kFloat).sum(2).contiguous();  // [M, Kp / G]
    const at::BFloat16* xv = xp.data_ptr<at::BFloat16>();
    const float* xs = xsum.data_ptr<float>();
    at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
      for (int64_t m = 0; m < M; m += kTile) {
        const int64_t mt = std::min(kTile, M - m);
        const at::BFloat16* xm = xv + m * Kp;
        const float* sm = xs + m * groups;
        switch (mt) {
          case 1: bf16_rows<1>(xm, sm, Kp, q, s, lo, n0, n1, y + m * N, N); break;
          case 2: bf16_rows<2>(xm, sm, Kp, q, s, lo, n0, n1, y + m * N, N); break;
          case 3: bf16_rows<3>(xm, sm, Kp, q, s, lo, n0, n1, y + m * N, N); break;
          default: bf16_rows<4>(xm, sm, Kp, q, s, lo, n0, n1, y + m * N, N); break;
        }
      }
    });
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
                              int64_t in_features, at::ScalarType dtype) {
  // -> [N, in_features] in dtype, for a dense product over many rows (prefill)
  const Int4Args w = check(packed, scale, low);
  TORCH_CHECK(in_features <= w.Kp && in_features > w.Kp - kBlock, "in_features must lie in the last 64-column block");
  torch::Tensor out = torch::empty({w.N, in_features}, packed.options().dtype(dtype));
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
