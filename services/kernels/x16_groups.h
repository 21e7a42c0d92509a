// x as int16 per group of 32 columns, for the kernels that multiply quantized weights by it with integer
// multiply-adds (int4_x16_linear.cpp, int8_x16_linear.cpp).
//
// Legend: M rows of x, K input features, Kp = K padded to whole groups (or blocks) by the caller,
// G = 32 columns per group, groups = Kp / G.
//   xq:     [M, Kp]      int16: rint(x * 32767 / amax) of each group (halves to even), 0 past K; each
//                        64-column block's columns in the order `columns` gives (none: column order)
//   xscale: [M, groups]  amax / 32767 of each group (0 for an all-zero group)
//   xsum:   [M, groups]  the sum of x itself over each group
//
// Why 16 bits: an element's error is at most amax / 65534, below bf16's own rounding (2^-9 of the
// element) for every element within 2^7 of its group's largest, so the product is the weight-only one
// up to less than the activations' rounding. 8 bits (llama.cpp's Q8_0 activations) were tried: through
// the decode path SmolLM2-135M's int4 logprobs moved from float32's by 0.122 against weight-only int4's
// 0.042 (top-1 90.4% vs 96.7%); 16 bits: 0.045 (96.1%). docs/kernels.md.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "thread_chunks.h"
#include "vec_load.h"

// The x16 kernels exist only where the CPU has AVX2, FMA and F16C.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// How far ahead of its reads a kernel prefetches W, a cache line per 64 bytes read: the hardware prefetcher
// alone left a 16384 x 2048 int4 product at 28 GB/s, 8 KB ahead at 32-34; 2 or 4 KB ran ~10% slower (int8 too;
// AMD EPYC Zen 3, read ceiling 38-50 GB/s). A prefetch is a hint: past the last row it never faults.
constexpr int64_t kPrefetchBytes = 8192;

struct X16Groups {
  std::vector<int16_t> xq;
  std::vector<float> xscale, xsum;
};

// Calls run(p) with y's data as float*, at::BFloat16* or at::Half*: kernels read x and write y in the model's
// dtype directly (a conversion by torch around each call cost ~20 us a product of a decode step).
template <typename Run>
inline void with_data(const torch::Tensor& t, Run run) {
  switch (t.scalar_type()) {
    case at::kFloat: run(t.data_ptr<float>()); break;
    case at::kBFloat16: run(t.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(t.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16, not ", t.scalar_type());
  }
}

// columns: for block order, the column (0..63) each of a 64-column block's slots holds; Kp whole blocks.
// A group is 4 vectors of 8: its largest magnitude and sum, then x * 32767 / amax converted with the CPU's
// rounding (to nearest, halves to even) and packed to int16 (the values are within +-32767: no saturation).
inline X16Groups x16_groups(const torch::Tensor& x, int64_t Kp, const std::vector<int>* columns = nullptr) {
  constexpr int64_t kGroup = 32, kBlock = 64;
  const int64_t M = x.size(0), K = x.size(1), groups = Kp / kGroup;
  TORCH_CHECK(Kp % kGroup == 0 && Kp >= K && (columns == nullptr || Kp % kBlock == 0), "bad padded width");
  const torch::Tensor xc = x.contiguous();
  X16Groups r{std::vector<int16_t>(M * Kp), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  std::vector<float> row(Kp, 0.f);  // one row as float32, zeros past K
  std::vector<int16_t> q(Kp);  // one row in column order
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  with_data(xc, [&](const auto* xv) {
    for (int64_t m = 0; m < M; ++m) {
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) _mm256_storeu_ps(row.data() + k, load8(xv + m * K + k));
      for (; k < K; ++k) row[k] = static_cast<float>(xv[m * K + k]);
      for (int64_t g = 0; g < groups; ++g) {
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(row.data() + g * kGroup + 8 * i);
        const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                         _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
        const float amax = max8(top);
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        __m256i i32[4];
        for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        // packs interleaves the 128-bit lanes: 0xD8 puts the four 64-bit quarters back in order
        const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[0], i32[1]), 0xD8);
        const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[2], i32[3]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + g * kGroup), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + g * kGroup + 16), hi);
        r.xscale[m * groups + g] = amax / 32767.f;
        r.xsum[m * groups + g] = sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
      }
      int16_t* out = r.xq.data() + m * Kp;
      if (columns == nullptr) {
        std::copy(q.begin(), q.end(), out);
      } else {
        for (int64_t b = 0; b < Kp / kBlock; ++b)
          for (int s = 0; s < kBlock; ++s) out[b * kBlock + s] = q[b * kBlock + (*columns)[s]];
      }
    }
  });
  return r;
}

// f(std::integral_constant<int, L>{}) with L the prefetch locality the kernels pass to __builtin_prefetch:
// 0 (non-temporal, past the caches) or 3 (into every level), so each kernel's loop is compiled once for each.
template <typename F>
auto with_prefetch_locality(bool non_temporal, F&& f) {
  return non_temporal ? f(std::integral_constant<int, 0>{}) : f(std::integral_constant<int, 3>{});
}

// y [M, N] in x's dtype (bias [N] added, each value rounded once) of a kernel whose
// rows(tile, parts, m, n, apart, acc) puts into acc[i * R + r] the float32 result of x row m + i against W row
// n + r * apart, for i < MT = decltype(tile)::value (1..4) and r < R = decltype(parts)::value (1..kMaxParts; R > 1
// only with MT = 1): compile-time constants, the kernels keep MT x R accumulators in registers. Threads take N's
// rows in chunks (thread_chunks.h); each chunk's W rows are streamed once for every 4 rows of x, as `streams`
// parts: for one x row (a decode step's batch of 1) a row of each part is read together, their streams
// interleaved cache line by cache line; for several, a row of each part in turn. The CPU's prefetchers follow each part as its own stream and DRAM serves
// them from different pages at once: on an AMD EPYC Zen 2 (2 threads, a cycle of distinct int8 weights, one x
// row) 4 parts read together streamed 28-31 GB/s against 21-26 for one part or 4 in turn; on a Zen 3, 4 parts in turn
// read ~1.17x faster than 1 (int4's kernel, bound by its arithmetic there, ~0.75x): the kernel plan times both
// (docs/kernels.md). int4_linear.cpp's AVX512-BF16 loop (bf16 x, not int16) reads its rows through it too.
constexpr int64_t kMaxParts = 4;

template <typename Rows>
torch::Tensor x16_product(const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& bias, int64_t streams,
                          Rows rows) {
  TORCH_CHECK(streams >= 1 && streams <= kMaxParts, "streams must be 1 to ", kMaxParts, ", got ", streams);
  constexpr int64_t kTile = 4;
  const int64_t M = x.size(0);
  const torch::Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  const float* bv = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  torch::Tensor y = torch::empty({M, N}, x.options());
  with_data(y, [&](auto* out) {
    using Out = std::remove_pointer_t<decltype(out)>;
    using One = std::integral_constant<int, 1>;
    parallel_chunks(N, [&](int64_t n0, int64_t n1) {
      float acc[std::max(kTile, kMaxParts)];
      const int64_t per = (n1 - n0) / streams;  // W rows of each part; the rest after them, in order
      for (int64_t m = 0; m < M; m += kTile) {
        const int64_t mt = std::min(kTile, M - m);
        auto store = [&](int64_t i, int64_t n, float v) {
          out[(m + i) * N + n] = static_cast<Out>(bv ? v + bv[n] : v);
        };
        auto row = [&](int64_t n) {
          switch (mt) {
            case 1: rows(One{}, One{}, m, n, 0, acc); break;
            case 2: rows(std::integral_constant<int, 2>{}, One{}, m, n, 0, acc); break;
            case 3: rows(std::integral_constant<int, 3>{}, One{}, m, n, 0, acc); break;
            default: rows(std::integral_constant<int, 4>{}, One{}, m, n, 0, acc); break;
          }
          for (int64_t i = 0; i < mt; ++i) store(i, n, acc[i]);
        };
        auto together = [&](auto parts) {  // row i of every part at once
          constexpr int R = decltype(parts)::value;
          for (int64_t i = 0; i < per; ++i) {
            rows(One{}, parts, m, n0 + i, per, acc);
            for (int r = 0; r < R; ++r) store(0, n0 + r * per + i, acc[r]);
          }
        };
        if (mt == 1 && streams == 2) together(std::integral_constant<int, 2>{});
        else if (mt == 1 && streams == 3) together(std::integral_constant<int, 3>{});
        else if (mt == 1 && streams == 4) together(std::integral_constant<int, 4>{});
        else
          for (int64_t i = 0; i < per; ++i)
            for (int64_t s = 0; s < streams; ++s) row(n0 + s * per + i);
        for (int64_t n = n0 + streams * per; n < n1; ++n) row(n);
      }
    });
  });
  return y;
}

#endif  // AVX2, FMA, F16C
