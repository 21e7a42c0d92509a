// Dense weights times many rows of x on CPUs with AVX2 and FMA but no 16-bit matrix instructions (AMD Zen 1-3,
// Intel client cores): y = x @ W^T (+ bias), every product in float32, each W element read from memory once.
//
// Legend: M rows of x, K input features, N output features; NR = 16 W rows per panel, KB = 1,024 columns per
// chunk, MR = 6: rows of x per register tile, at most.
//   x:     [M, K]   float32 / bfloat16 / float16
//   xp:    [K/KB chunks][ceil(M/MR) tiles][kb, mr]  float32: x packed once per call (kb, mr: the chunk's
//                   columns, the tile's rows), so that a step of k broadcasts mr adjacent values and a chunk is
//                   one stream
//   w:     [N, K]   float32 / bfloat16 / float16, or int8 with scale [N] float32 (w_real[n, k] = w[n, k] * scale[n]);
//                   contiguous
//   bias:  [N]      optional
//   y:     [M, N]   x's dtype, accumulated in float32 and rounded once
//   panel: [kb, NR] float32, per thread: one chunk of W[n0 .. n0 + NR, :] transposed (rows past N are 0; 64-byte
//                   aligned: a panel row is one cache line)
//   tile:  [M, NR]  float32, per thread: the chunk's sums for y's columns n0 .. n0 + NR
//
// Why: the streaming kernel (skinny_linear.cpp) reads W once per 4 rows of x, so 32 rows read it 8 times,
// and torch's float32 GEMMs there reach half the FMA rate (AMD EPYC Zen 2, 2 threads: 152 GFLOP/s of FMAs,
// MKL 61 and oneDNN 89 on 1,024 rows of 16384 x 2048). Here the C tile of 6 x 16 stays in 12 registers; a
// step of k loads 2 vectors of the panel and broadcasts 6 values of x for 12 FMAs (BLIS's Haswell shape),
// so the FMA units, not the loads, set the pace. Every panel reads all of x's current chunk: chunks of 1,024
// columns keep that (4 MB at a prefill's 1,024 rows) in the L3, where x whole (32 MB at K = 8,192) would come
// from memory once per panel (measured there: 85 GFLOP/s whole, 145 in chunks; oneDNN 142). Each tile runs over
// the whole chunk, the panel's 64 KB read from L2: slices of 256 columns kept in L1 (BLIS's KC) were 5-13% slower
// here (Zen 2, 1,024 rows), paying a round trip of the C tile and a short loop's start per slice.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_load.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

constexpr int64_t kNR = 16, kMR = 6, kPrefetch = 256, kKB = 1024;
constexpr int64_t kStreamBytes = 8 << 20;  // y from this size on is written past the caches

// rows [8] of 8 floats each -> out [8]: out[j] = (rows[0][j], ..., rows[7][j])
inline void transpose8(const __m256 rows[8], __m256 out[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    const __m256 *a = t + 4 * h;
    s[4 * h + 0] = _mm256_shuffle_ps(a[0], a[2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(a[0], a[2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(a[1], a[3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(a[1], a[3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    out[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}

// panel [K, NR] = the `rows` W rows from w on (`stride` elements apart; the rest 0), as float32
template <typename T>
void pack(const T* w, int64_t stride, int64_t K, int64_t rows, float* panel) {
  int64_t k = 0;
  if (rows == kNR) {
    // W read as 8 streams, a row each, for one half of the panel, then the other: each row's reads run kPrefetch
    // bytes behind its prefetches. All 16 rows at once (16 streams) was 3-16% slower at 8-32 rows of x, where the
    // packing is a fifth of the time (Zen 2; the same at 1,024 rows)
    const int64_t K8 = K / 8 * 8;
    for (int half = 0; half < 2; ++half) {
      const T* rows8 = w + 8 * half * stride;
      for (k = 0; k < K8; k += 8) {
        if ((k * sizeof(T)) % 64 == 0)
          for (int r = 0; r < 8; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(rows8 + r * stride + k) + kPrefetch, _MM_HINT_T0);
        __m256 in[8], out[8];
        for (int r = 0; r < 8; ++r) in[r] = load8(rows8 + r * stride + k);
        transpose8(in, out);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(panel + (k + j) * kNR + 8 * half, out[j]);
      }
    }
    k = K8;
  }
  for (; k < K; ++k)
    for (int64_t r = 0; r < kNR; ++r) panel[k * kNR + r] = r < rows ? scalar_to_float(w[r * stride + k]) : 0.f;
}

// c [MR, NR] = xt [kc, MR] . panel [kc, NR]: xt is one tile of x, packed. The loops over i are unrolled by
// pragma so that GCC keeps the 2 MR accumulators in registers (left to itself it stored them to the stack every
// step, at half the FMA rate).
template <int MR>
void tile(const float* xt, const float* panel, int64_t kc, float* c) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    lo[i] = _mm256_setzero_ps();
    hi[i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kNR), b1 = _mm256_loadu_ps(panel + k * kNR + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(xt + k * MR + i);
      lo[i] = _mm256_fmadd_ps(a, b0, lo[i]);
      hi[i] = _mm256_fmadd_ps(a, b1, hi[i]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(c + i * kNR, lo[i]);
    _mm256_storeu_ps(c + i * kNR + 8, hi[i]);
  }
}

void rows_tile(int64_t mr, const float* xt, const float* panel, int64_t kc, float* c) {
  switch (mr) {
    case 1: tile<1>(xt, panel, kc, c); break;
    case 2: tile<2>(xt, panel, kc, c); break;
    case 3: tile<3>(xt, panel, kc, c); break;
    case 4: tile<4>(xt, panel, kc, c); break;
    case 5: tile<5>(xt, panel, kc, c); break;
    default: tile<6>(xt, panel, kc, c); break;
  }
}

// x's rows in ceil(M / MR) tiles of nearly equal size: 32 rows as 6 6 5 5 5 5, not 6 6 6 6 6 2, whose last tile
// would have 4 accumulators, too few to cover the FMA's latency (Zen 2, 32 rows: 4-6% faster)
struct RowTiles {
  int64_t count, base, extra;
  explicit RowTiles(int64_t M) : count((M + kMR - 1) / kMR), base(M / std::max<int64_t>(count, 1)),
                                 extra(M % std::max<int64_t>(count, 1)) {}
  int64_t start(int64_t t) const { return t * base + std::min(t, extra); }
  int64_t rows(int64_t t) const { return base + (t < extra ? 1 : 0); }
};

// xp = x packed (see the legend)
template <typename T>
void pack_x(const T* x, int64_t M, int64_t K, float* xp) {
  const RowTiles tiles(M);
  at::parallel_for(0, tiles.count, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = tiles.start(t), mr = tiles.rows(t);
      for (int64_t c0 = 0; c0 < K; c0 += kKB) {
        const int64_t kb = std::min(kKB, K - c0);
        float* out = xp + c0 * M + m0 * kb;
        for (int64_t k = 0; k < kb; ++k)
          for (int64_t i = 0; i < mr; ++i) out[k * mr + i] = scalar_to_float(x[(m0 + i) * K + c0 + k]);
      }
    }
  });
}

template <typename T>
void product(const float* xp, const T* w, const float* scale, int64_t M, int64_t N, int64_t K, float* y) {
  const bool stream = M * N * 4 >= kStreamBytes && N % kNR == 0 && (reinterpret_cast<uintptr_t>(y) & 63) == 0;
  const RowTiles tiles(M);
  for (int64_t c0 = 0; c0 < K; c0 += kKB) {
    const int64_t kb = std::min(kKB, K - c0);
    const float* xc = xp + c0 * M;
    at::parallel_for(0, (N + kNR - 1) / kNR, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> panel_store(kb * kNR + 16), tile_c(M * kNR);
      const uintptr_t at64 = (reinterpret_cast<uintptr_t>(panel_store.data()) + 63) & ~uintptr_t(63);
      float* panel = reinterpret_cast<float*>(at64);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kNR, rows = std::min(kNR, N - n0);
        pack(w + n0 * K + c0, K, kb, rows, panel);
        for (int64_t t = 0; t < tiles.count; ++t) {
          const int64_t m = tiles.start(t);
          rows_tile(tiles.rows(t), xc + m * kb, panel, kb, tile_c.data() + m * kNR);
        }
        const bool last = c0 + kb == K;  // y holds the earlier chunks' sums
        if (stream && rows == kNR) {
          // a prefill's y, in whole cache lines, stored past the caches: its rows are N floats apart, often a
          // multiple of 4 KB, so the 64 bytes each row gets from a panel would all land in one cache set,
          // evicting x and the panel (Zen 2, 1,024 rows: +3-10% on the 1b preset's four shapes)
          const __m256 s0 = last && scale ? _mm256_loadu_ps(scale + n0) : _mm256_set1_ps(1.f);
          const __m256 s1 = last && scale ? _mm256_loadu_ps(scale + n0 + 8) : _mm256_set1_ps(1.f);
          for (int64_t m = 0; m < M; ++m) {
            float* out = y + m * N + n0;
            __m256 v0 = _mm256_loadu_ps(tile_c.data() + m * kNR), v1 = _mm256_loadu_ps(tile_c.data() + m * kNR + 8);
            if (c0 > 0) {
              v0 = _mm256_add_ps(v0, _mm256_load_ps(out));
              v1 = _mm256_add_ps(v1, _mm256_load_ps(out + 8));
            }
            _mm256_stream_ps(out, _mm256_mul_ps(v0, s0));
            _mm256_stream_ps(out + 8, _mm256_mul_ps(v1, s1));
          }
        } else {
          for (int64_t m = 0; m < M; ++m)
            for (int64_t r = 0; r < rows; ++r) {
              const float v = tile_c[m * kNR + r] + (c0 > 0 ? y[m * N + n0 + r] : 0.f);
              y[m * N + n0 + r] = last && scale ? v * scale[n0 + r] : v;
            }
        }
      }
      if (stream) _mm_sfence();  // the streamed stores reach memory before any thread reads y
    });
  }
}

}  // namespace

torch::Tensor tiled_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.is_contiguous(), "CPU tensors and a contiguous w expected");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(scale.has_value() == (w.scalar_type() == at::kChar), "a scale goes with int8 weights, and only with them");
  const torch::Tensor scale32 = scale.has_value() ? scale->to(at::kFloat).contiguous() : torch::Tensor();
  TORCH_CHECK(!scale.has_value() || scale32.numel() == N, "scale must have one entry per output row");
  const float* sv = scale.has_value() ? scale32.data_ptr<float>() : nullptr;
  const torch::Tensor xc = x.contiguous();
  torch::Tensor xp = torch::empty({M, K}, xc.options().dtype(at::kFloat));
  // every element is written below, except when K = 0: then the product is all zeros
  torch::Tensor y = K > 0 ? torch::empty({M, N}, xp.options()) : torch::zeros({M, N}, xp.options());
  float* xpv = xp.data_ptr<float>();
  switch (xc.scalar_type()) {
    case at::kFloat: pack_x(xc.data_ptr<float>(), M, K, xpv); break;
    case at::kBFloat16: pack_x(xc.data_ptr<at::BFloat16>(), M, K, xpv); break;
    case at::kHalf: pack_x(xc.data_ptr<at::Half>(), M, K, xpv); break;
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16, not ", xc.scalar_type());
  }
  float* yv = y.data_ptr<float>();
  if (K > 0) {
    switch (w.scalar_type()) {
      case at::kFloat: product(xpv, w.data_ptr<float>(), sv, M, N, K, yv); break;
      case at::kBFloat16: product(xpv, w.data_ptr<at::BFloat16>(), sv, M, N, K, yv); break;
      case at::kHalf: product(xpv, w.data_ptr<at::Half>(), sv, M, N, K, yv); break;
      case at::kChar: product(xpv, w.data_ptr<int8_t>(), sv, M, N, K, yv); break;
      default: TORCH_CHECK(false, "w must be float32, bfloat16, float16 or int8, not ", w.scalar_type());
    }
  }
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y.to(x.scalar_type());
}

#endif  // AVX2, FMA, F16C
