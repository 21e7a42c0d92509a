// The loops shared by the 16-row panel products (int4_, int8_ and bf16_panel_linear.cpp): which panels and rows
// of x each call of a kernel's dots takes, the sums' rounding into y, and the dispatch over threads and prefetch hints.
//
// Legend: M rows of x, N output features, P = ceil(N / 16) panels, Tile x rows a pass over a panel (kTile = 8 unless
// a kernel's registers hold fewer).
//   Dots:  a kernel's product of panels by rows of x: `dots.template run<MT, S, Locality>(p, apart, m0, sums)` writes
//          sums[(s * MT + m) * 16 + r] = x row m0 + m . W row 16 (p + s * apart) + r, for S panels `apart` apart
//   bias:  [N] float32 or nullptr;  y: [M, N] bf16, each sum (+ bias) rounded once (w4a8_panels.h's store_row)
// One x row: each thread's panels read as `streams` parts (1, 2 or 4), a panel of each together. Several rows: each
// panel (or PairRows adjacent panels together) once from memory, against Tile rows of x at a time (later passes find
// it in L2).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "count_dispatch.h"
#include "thread_chunks.h"
#include "w4a8_panels.h"
#include "x16_groups.h"

namespace panel_rows {

constexpr int64_t kPanel = 16, kTile = 8;

template <typename Dots, int PairRows, int Tile, int StreamRows = 0>
struct Rows {
  const Dots& dots;
  const float* bias;
  int64_t M, N;
  at::BFloat16* y;

  template <int MT, int S, int Locality>
  void panel(int64_t p, int64_t apart, int64_t m0) const {
    alignas(64) float sums[S * MT * kPanel];
    dots.template run<MT, S, Locality>(p, apart, m0, sums);
    for (int s = 0; s < S; ++s) {
      const int64_t n0 = (p + s * apart) * kPanel, live = std::min(kPanel, N - n0);
      for (int m = 0; m < MT; ++m)
        w4a8::store_row(sums + (s * MT + m) * kPanel, bias ? bias + n0 : nullptr, live, y + (m0 + m) * N + n0);
    }
  }

  template <int S, int Locality>
  void one_row(int64_t p0, int64_t p1) const {
    const int64_t per = (p1 - p0) / S;
    for (int64_t p = p0; p < p0 + per; ++p) panel<1, S, Locality>(p, per, 0);
    for (int64_t p = p0 + S * per; p < p1; ++p) panel<1, 1, Locality>(p, 0, 0);
  }

  template <int S, int Locality>
  void passes(int64_t p) const {
    for (int64_t m0 = 0; m0 < M; m0 += Tile)
      with_count(std::min<int64_t>(Tile, M - m0), [&](auto rows) {
        if constexpr (decltype(rows)::value <= Tile) panel<decltype(rows)::value, S, Locality>(p, 1, m0);
      });
  }

  // Up to StreamRows rows of x: each thread's panels read as two streams (`per` apart), each panel once.
  template <int Locality>
  void two_streams(int64_t p0, int64_t p1) const {
    with_count(M, [&](auto rows) {
      constexpr int MT = decltype(rows)::value;
      if constexpr (MT <= StreamRows) {
        const int64_t per = (p1 - p0) / 2;
        for (int64_t p = p0; p < p0 + per; ++p) panel<MT, 2, Locality>(p, per, 0);
        for (int64_t p = p0 + 2 * per; p < p1; ++p) panel<MT, 1, Locality>(p, 1, 0);
      }
    });
  }

  template <int Locality>
  void rows(int64_t p0, int64_t p1) const {
    int64_t p = p0;
    for (; p + PairRows <= p1; p += PairRows) passes<PairRows, Locality>(p);
    for (; p < p1; ++p) passes<1, Locality>(p);
  }
};

// The checks every panel product makes of its call: x a CPU bf16 [M, K], one-row streams 1, 2 or 4.
inline void check_call(const torch::Tensor& x, int64_t streams) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "x must be a CPU bfloat16 [M, K]");
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4, "streams must be 1, 2 or 4, got ", streams);
  TORCH_CHECK(x.size(1) > 0, "x must have columns");
}

// x's rows padded with zeros to `columns` (>= K): [M, columns] bf16, what the panel kernels read x's pairs from
inline std::vector<at::BFloat16> padded_x(const torch::Tensor& x, int64_t columns) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::BFloat16> xp(M * columns, at::BFloat16(0.f));
  const torch::Tensor xc = x.contiguous();
  const at::BFloat16* xv = xc.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < M; ++m) std::copy(xv + m * K, xv + (m + 1) * K, xp.begin() + m * columns);
  return xp;
}

// bias [N] in float32 (the sums' dtype), or an undefined tensor where there is none
inline torch::Tensor float_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->numel() == N, "bias must have N elements");
  return bias->to(at::kFloat).contiguous();
}

// y = the product of `dots` for all M rows of x, its panels shared among the threads; `streams` 2 with up to StreamRows
// rows: each thread's panels as two streams (a kernel whose registers hold 2 StreamRows rows' sums).
template <int PairRows, int Tile = kTile, int StreamRows = 0, typename Dots>
void run(const Dots& dots, const torch::Tensor& bias, int64_t M, int64_t N, at::BFloat16* y, int64_t streams,
         bool non_temporal) {
  const Rows<Dots, PairRows, Tile, StreamRows> rows{dots, bias.defined() ? bias.data_ptr<float>() : nullptr, M, N, y};
  with_prefetch_locality(non_temporal, [&](auto locality) {
    constexpr int L = decltype(locality)::value;
    parallel_chunks((N + kPanel - 1) / kPanel, [&](int64_t p0, int64_t p1) {
      if (M > 1 && M <= StreamRows && streams == 2) rows.template two_streams<L>(p0, p1);
      else if (M > 1) rows.template rows<L>(p0, p1);
      else if (streams == 4) rows.template one_row<4, L>(p0, p1);
      else if (streams == 2) rows.template one_row<2, L>(p0, p1);
      else rows.template one_row<1, L>(p0, p1);
    });
    return 0;
  });
}

}  // namespace panel_rows
