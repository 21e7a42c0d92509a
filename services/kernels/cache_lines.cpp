// A tensor's bytes flushed out of every level of the CPU's caches, so a decode product can be timed with its weight in
// memory, as a decode step reads it (cold_cache.py).
//
// Legend: t a contiguous CPU tensor: numel() * element_size() bytes from data_ptr(), one 64-byte line at a time.
//
// Why: reading a buffer twice the cache's size instead (what cold_cache.py did first) evicts too little from a large
// adaptive L3: on an Intel Xeon with 300 MB (family 6 model 207) a weight timed 7 times between reads of a 600 MB
// buffer kept much of itself there — the cache keeps lines that are hit again and lets a stream that never is go — so
// a 16384 x 2048 int8 product "read" 40 GB/s against a 32 GB/s read ceiling, and the kernel that won there lost by 13%
// in the decode step. A flush is exact, and cheap: ~4 ms for 32 MB.

#include <torch/extension.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

void flush_cache_lines(const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "a contiguous CPU tensor expected");
  char* p = static_cast<char*>(t.data_ptr());
  const int64_t bytes = t.numel() * t.element_size();
  for (int64_t i = 0; i < bytes; i += 64) {
#if defined(__CLFLUSHOPT__)
    _mm_clflushopt(p + i);
#else
    _mm_clflush(p + i);
#endif
  }
  if (bytes > 0) _mm_clflush(p + bytes - 1);  // the last line, where the storage does not start on a line
  _mm_mfence();  // the flushes done before the timed call starts
}
#endif
