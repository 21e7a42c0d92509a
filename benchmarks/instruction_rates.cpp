// Multiply-accumulates per nanosecond that this CPU's vector instructions sustain on T threads: each
// idiom runs as kChains independent chains (more than latency x ports, so the ports, not a chain's latency,
// set the rate), in registers, on values the compiler must treat as changing every step (OPAQUE), so
// nothing is hoisted out of the loop or folded. The integer idioms multiply each chain's own accumulator
// (with shared operands the compiler would compute the product once for all chains).
// benchmarks/instruction_rates.py prints them and the floors they set.
//
// Each probe returns a float from its accumulators so that the work is live; its value means nothing.
// Without AVX2 and FMA (another architecture, an old x86) there is no idiom to probe: the list is empty.

#include <torch/extension.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int kChains = 10;  // independent chains per probe, in registers (AVX2 has 16)

struct Idiom {
  std::string name;
  int macs;  // multiply-accumulates one step of one chain does
  float (*run)(int64_t);
};

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
// v stays in a vector register, and as far as the compiler knows it changes here.
#define OPAQUE(v) asm volatile("" : "+x"(v))

float lanes(__m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  return f[0] + f[7];
}

float lanes(__m256i v) { return lanes(_mm256_cvtepi32_ps(v)); }

// vfmadd231ps ymm: 8 float32 products added, the float32 path of every kernel without 16-bit arithmetic.
float fma_ps(int64_t steps) {
  __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-9f);
#define DECLARE(i) __m256 acc##i = _mm256_set1_ps(i);
  CHAINS(DECLARE)
#undef DECLARE
  for (int64_t s = 0; s < steps; ++s) {
    OPAQUE(b);
#define STEP(i) acc##i = _mm256_fmadd_ps(a, b, acc##i);
    CHAINS(STEP)
#undef STEP
  }
  __m256 sum = acc0;
#define ADD(i) sum = _mm256_add_ps(sum, acc##i);
  CHAINS(ADD)
#undef ADD
  return lanes(sum);
}

// vpmaddwd + vpaddd ymm: 16 int16 products, pairs summed into int32 (the x16 kernels' inner step).
float madd_epi16(int64_t steps) {
  __m256i b = _mm256_set1_epi16(5);
#define DECLARE(i) __m256i acc##i = _mm256_set1_epi32(i);
  CHAINS(DECLARE)
#undef DECLARE
  for (int64_t s = 0; s < steps; ++s) {
    OPAQUE(b);
#define STEP(i) acc##i = _mm256_add_epi32(acc##i, _mm256_madd_epi16(acc##i, b));
    CHAINS(STEP)
#undef STEP
  }
  __m256i sum = acc0;
#define ADD(i) sum = _mm256_add_epi32(sum, acc##i);
  CHAINS(ADD)
#undef ADD
  return lanes(sum);
}

// vpmaddubsw + vpmaddwd(ones) + vpaddd ymm: 32 uint8 x int8 products into int32 (llama.cpp's Q8_0 and Q4_0
// dot on AVX2; both operands 8-bit).
float maddubs_epi16(int64_t steps) {
  __m256i b = _mm256_set1_epi8(5);
  const __m256i ones = _mm256_set1_epi16(1);
#define DECLARE(i) __m256i acc##i = _mm256_set1_epi32(i);
  CHAINS(DECLARE)
#undef DECLARE
  for (int64_t s = 0; s < steps; ++s) {
    OPAQUE(b);
#define STEP(i) acc##i = _mm256_add_epi32(acc##i, _mm256_madd_epi16(_mm256_maddubs_epi16(acc##i, b), ones));
    CHAINS(STEP)
#undef STEP
  }
  __m256i sum = acc0;
#define ADD(i) sum = _mm256_add_epi32(sum, acc##i);
  CHAINS(ADD)
#undef ADD
  return lanes(sum);
}

#if defined(__AVX512F__)
float lanes(__m512 v) { return _mm512_reduce_add_ps(v); }

// vfmadd231ps zmm: 16 float32 products.
float fma_ps512(int64_t steps) {
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
#define DECLARE(i) __m512 acc##i = _mm512_set1_ps(i);
  CHAINS(DECLARE)
#undef DECLARE
  for (int64_t s = 0; s < steps; ++s) {
    asm volatile("" : "+v"(b));
#define STEP(i) acc##i = _mm512_fmadd_ps(a, b, acc##i);
    CHAINS(STEP)
#undef STEP
  }
  __m512 sum = acc0;
#define ADD(i) sum = _mm512_add_ps(sum, acc##i);
  CHAINS(ADD)
#undef ADD
  return lanes(sum);
}
#endif

#if defined(__AVX512BF16__)
// vdpbf16ps zmm: 32 bfloat16 products, pairs summed into float32 (the bf16 kernels on Zen 4 / Cooper Lake).
float dpbf16_ps(int64_t steps) {
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x3000);
#define DECLARE(i) __m512 acc##i = _mm512_set1_ps(i);
  CHAINS(DECLARE)
#undef DECLARE
  for (int64_t s = 0; s < steps; ++s) {
    asm volatile("" : "+v"(b));
#define STEP(i) acc##i = _mm512_dpbf16_ps(acc##i, a, b);
    CHAINS(STEP)
#undef STEP
  }
  __m512 sum = acc0;
#define ADD(i) sum = _mm512_add_ps(sum, acc##i);
  CHAINS(ADD)
#undef ADD
  return lanes(sum);
}
#endif

#if defined(__AVX512VNNI__)
// vpdpbusd zmm: 64 uint8 x int8 products, fours summed into int32 (native.w8a8 on AVX512-VNNI).
float dpbusd_epi32(int64_t steps) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
#define DECLARE(i) __m512i acc##i = _mm512_set1_epi32(i);
  CHAINS(DECLARE)
#undef DECLARE
  for (int64_t s = 0; s < steps; ++s) {
    asm volatile("" : "+v"(b));
#define STEP(i) acc##i = _mm512_dpbusd_epi32(acc##i, a, b);
    CHAINS(STEP)
#undef STEP
  }
  __m512i sum = acc0;
#define ADD(i) sum = _mm512_add_epi32(sum, acc##i);
  CHAINS(ADD)
#undef ADD
  return lanes(_mm512_cvtepi32_ps(sum));
}
#endif

std::vector<Idiom> idioms() {
  std::vector<Idiom> all = {{"float32 FMA (vfmadd231ps ymm)", 8, fma_ps},
                            {"int16 pairs (vpmaddwd + vpaddd ymm)", 16, madd_epi16},
                            {"int8 (vpmaddubsw + vpmaddwd + vpaddd ymm)", 32, maddubs_epi16}};
#if defined(__AVX512F__)
  all.push_back({"float32 FMA (vfmadd231ps zmm)", 16, fma_ps512});
#endif
#if defined(__AVX512BF16__)
  all.push_back({"bfloat16 pairs (vdpbf16ps zmm)", 32, dpbf16_ps});
#endif
#if defined(__AVX512VNNI__)
  all.push_back({"int8 fours (vpdpbusd zmm)", 64, dpbusd_epi32});
#endif
  return all;
}

}  // namespace
#else
namespace {
std::vector<Idiom> idioms() { return {}; }
}  // namespace
#endif

namespace {
volatile float sink;  // keeps every probe's result alive
}  // namespace

// [(idiom, MACs per nanosecond over all threads)], each the best of `repeats` runs of `steps` steps a thread.
std::vector<std::pair<std::string, double>> instruction_rates(int64_t threads, int64_t steps, int64_t repeats) {
  TORCH_CHECK(threads >= 1 && steps >= 1 && repeats >= 1, "threads, steps and repeats must be at least 1");
  std::vector<std::pair<std::string, double>> rates;
  for (const Idiom& idiom : idioms()) {
    double best = 0.0;
    for (int64_t r = 0; r < repeats; ++r) {
      float total = 0.f;
      const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
      total += idiom.run(steps);
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
      sink = total;
      best = std::max(best, double(threads) * steps * kChains * idiom.macs / ns);
    }
    rates.emplace_back(idiom.name, best);
  }
  return rates;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("instruction_rates", &instruction_rates, py::arg("threads"), py::arg("steps"), py::arg("repeats"));
}
