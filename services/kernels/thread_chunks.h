// How a decode product's threads share its W rows: in chunks they take in turn from a shared counter.
//
// Legend: count items (W rows, groups of rows, or panels), threads = at::get_num_threads(); chunk c = items
// [bounds[c], bounds[c + 1]), in order, each a share of what the chunks before it left (below).
//
// Why: a product is a few milliseconds of streaming W, and fixed halves left one thread waiting at the end of every
// product whenever the other ran slower (its core shared with a neighbour, or its half of W in slower pages). With 16
// chunks a thread the faster thread takes the slower one's remaining chunks: the 65 bf16 products of a `1b` decode
// step, AMD EPYC Zen 4, 2 threads, alternated in one process, 75.9 -> 71.3 and 80.4 -> 74.6 ms (median; 31 and 25 of
// 40 rounds faster). Each chunk is still one contiguous stream, and each item's result is the same whoever computes
// it. Nested in a parallel region (at::parallel_for runs inline there) the one caller takes every chunk.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

// Chunks shrink as the work runs out: each takes a kShare-th of what is left per thread, down to a smallest of
// 1 / (kFinest x threads) of the whole. Why: with equal chunks (16 a thread) the thread that took the last one finished
// half a chunk after the other on average — 1/64 of every product, waited out in OpenMP's barrier (3% of a `1b`
// batch-32 step's samples). The `1b` bf16 decode step, old and new builds in alternated processes: 67.7 / 66.0 / 67.2
// -> 65.7 / 65.6 / 65.9 ms (medians of 4 x 16 tokens; Intel Xeon family 6 model 207, 2 threads); its batch-32 step
// and int8's batch-1 step within the runs' noise (115-121, 32.9-36.4 ms either way).
constexpr int64_t kShare = 4, kFinest = 64;

// body(i0, i1) for every chunk of [0, count), each chunk on one thread.
template <typename Body>
void parallel_chunks(int64_t count, const Body& body) {
  const int64_t threads = at::get_num_threads();
  if (count <= 0) return;
  const int64_t finest = std::max<int64_t>(1, count / (kFinest * threads));
  std::vector<int64_t> bounds{0};  // ~15 chunks a thread: 11 shrinking to 1/16 of the whole left, 4 of the finest
  for (int64_t done = 0; done < count;) {
    done += std::min(count - done, std::max(finest, (count - done) / (kShare * threads)));
    bounds.push_back(done);
  }
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next_chunk.fetch_add(1)) < chunks;) body(bounds[c], bounds[c + 1]);
  });
}
