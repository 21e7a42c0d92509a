// How a decode product's threads share its W rows: in chunks they take in turn from a shared counter.
//
// Legend: count items (W rows, groups of rows, or panels), threads = at::get_num_threads(),
// chunks = min(count, kChunksPerThread * threads), chunk c = items [c * count / chunks, (c + 1) * count / chunks).
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

constexpr int64_t kChunksPerThread = 16;

// body(i0, i1) for every chunk of [0, count), each chunk on one thread.
template <typename Body>
void parallel_chunks(int64_t count, const Body& body) {
  const int64_t threads = at::get_num_threads(), chunks = std::min(count, kChunksPerThread * threads);
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next_chunk.fetch_add(1)) < chunks;) body(c * count / chunks, (c + 1) * count / chunks);
  });
}
