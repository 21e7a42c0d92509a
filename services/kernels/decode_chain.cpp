// A decode step's decoder layers in one native call: the same kernels, in the same order, that the model's Python
// forward calls one by one (skinny_linear.cpp, decoder_glue.cpp — its silu_mul, or torch's silu and mul on builds
// without glue_lanes.h's lanes — paged_decode_attention.cpp), so every value is the one that forward computes, bit
// for bit.
//
// Legend: N rows (one new token per sequence), D hidden size, H query heads, K kv heads, Dh head dim, F
// intermediate size, L layers, S pool slots.
//   products:   4 L in layer order (decode_chain.h), each the kernel the plan chose for this row count: qkv
//               [(H + 2K) Dh, D] (with its bias, if any), o [D, H Dh], gate_up [2F, D], down [D, F]
//   post_norms, next_norms: L x [D] (next: the following layer's input norm, the last layer's the final norm)
//   q_norms, k_norms: L x [Dh] or None (Qwen3: each head of q and k normalized before the rotation)
//   run(h, x, ...): h [N, D] the residual stream (updated in place), x [N, D] its normalized copy, the first layer's
//               input; kv_cache [L, 2, S, K, Dh]; slot_mapping [N] int64 (where each new k / v goes);
//               block_tables [N, max_blocks], context_lens [N] int64; cos, sin_signed [N, Dh]
//               -> x after the last layer (normalized by the final norm), [N, D]
//
// Why: a bf16 `1b` decode step spent ~5 ms outside its products on an AMD EPYC Zen 4 (2 threads), against ~56 ms of
// products: half of it Python and torch's dispatch around ~12 operators a layer, half the caches refilling with that
// code and its data after every weight had streamed through them. Here only the kernels' own code runs between the
// products.

#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "decode_chain.h"
#include "glue_lanes.h"

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                            const c10::optional<torch::Tensor>& bias, int64_t rows, bool non_temporal, bool parts);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low, const c10::optional<torch::Tensor>& bias, int64_t streams,
                          bool non_temporal);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_X16_KERNELS
torch::Tensor int4_x16_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                              const torch::Tensor& low, const c10::optional<torch::Tensor>& bias, int64_t streams,
                              bool non_temporal);
torch::Tensor int8_x16_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal);
#endif
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define PDSERVE_INT8_DIGITS
torch::Tensor int8_digits_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                 const c10::optional<torch::Tensor>& bias);
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor w4a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PDSERVE_PANELS
torch::Tensor int4_panel_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                                const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias,
                                int64_t streams, bool non_temporal);
torch::Tensor bf16_panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                                const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PDSERVE_INT8_PANELS
torch::Tensor int8_panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                int64_t N, const c10::optional<torch::Tensor>& bias, int64_t streams,
                                bool non_temporal);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PDSERVE_W8A8_ROWS
torch::Tensor w8a8_row_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal);
#endif
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     int64_t block_size, double scale);
torch::Tensor residual_rms_norm(torch::Tensor& h, const c10::optional<torch::Tensor>& delta,
                                const torch::Tensor& weight, double eps);
void rotate_heads(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed);

ChainProduct::ChainProduct(std::string name, std::vector<c10::optional<torch::Tensor>> tensors_,
                           c10::optional<torch::Tensor> bias_, std::vector<int64_t> options_, py::object call_)
    : tensors(std::move(tensors_)), bias(std::move(bias_)), options(std::move(options_)), call(std::move(call_)) {
  size_t want_tensors = 0, want_options = 2;
  if (name == "skinny") kernel = Kernel::kSkinny, want_tensors = 2, want_options = 3;
  else if (name == "int4") kernel = Kernel::kInt4, want_tensors = 3;
#if defined(PDSERVE_X16_KERNELS)
  else if (name == "int8_x16") kernel = Kernel::kInt8X16, want_tensors = 2;
  else if (name == "int4_x16") kernel = Kernel::kInt4X16, want_tensors = 3;
#endif
#if defined(PDSERVE_INT8_DIGITS)
  else if (name == "int8_digits") kernel = Kernel::kInt8Digits, want_tensors = 2, want_options = 0;
  else if (name == "w8a8") kernel = Kernel::kW8a8, want_tensors = 2, want_options = 0;
  else if (name == "w4a8") kernel = Kernel::kW4a8, want_tensors = 3, want_options = 1;
#endif
#if defined(PDSERVE_W8A8_ROWS)
  else if (name == "w8a8_row") kernel = Kernel::kW8a8Row, want_tensors = 2;
#endif
#if defined(PDSERVE_PANELS)
  else if (name == "int4_panels") kernel = Kernel::kInt4Panels, want_tensors = 3, want_options = 3;
  else if (name == "bf16_panels") kernel = Kernel::kBf16Panels, want_tensors = 1, want_options = 3;
#endif
#if defined(PDSERVE_INT8_PANELS)
  else if (name == "int8_panels") kernel = Kernel::kInt8Panels, want_tensors = 2, want_options = 3;
#endif
  else if (name == "call") kernel = Kernel::kCall, want_options = 0;
  else TORCH_CHECK(false, "no chain kernel named ", name, " in this build");
  TORCH_CHECK(tensors.size() == want_tensors && options.size() == want_options, name, " takes ", want_tensors,
              " tensors and ", want_options, " options");
  TORCH_CHECK(kernel != Kernel::kCall || PyCallable_Check(call.ptr()), "a \"call\" product needs a callable");
  for (size_t i = 0; i < want_tensors; ++i)  // only skinny's scale may be None (a dense weight)
    TORCH_CHECK(tensors[i].has_value() || (kernel == Kernel::kSkinny && i == 1), name, ": tensor ", i, " is None");
}

torch::Tensor ChainProduct::operator()(const torch::Tensor& x) const {
  switch (kernel) {
    case Kernel::kSkinny: return skinny_linear(x, *tensors[0], tensors[1], bias, options[0], options[1], options[2]);
    case Kernel::kInt4: return int4_linear(x, *tensors[0], *tensors[1], *tensors[2], bias, options[0], options[1]);
#if defined(PDSERVE_X16_KERNELS)
    case Kernel::kInt8X16: return int8_x16_linear(x, *tensors[0], *tensors[1], bias, options[0], options[1]);
    case Kernel::kInt4X16: return int4_x16_linear(x, *tensors[0], *tensors[1], *tensors[2], bias, options[0], options[1]);
#endif
#if defined(PDSERVE_INT8_DIGITS)
    case Kernel::kInt8Digits: return int8_digits_linear(x, *tensors[0], *tensors[1], bias);
    case Kernel::kW8a8: return w8a8_linear(x, *tensors[0], *tensors[1], bias);
    case Kernel::kW4a8: return w4a8_linear(x, *tensors[0], *tensors[1], *tensors[2], options[0], bias);
#endif
#if defined(PDSERVE_W8A8_ROWS)
    case Kernel::kW8a8Row: return w8a8_row_linear(x, *tensors[0], *tensors[1], bias, options[0], options[1]);
#endif
#if defined(PDSERVE_PANELS)
    case Kernel::kInt4Panels:
      return int4_panel_linear(x, *tensors[0], *tensors[1], *tensors[2], options[0], bias, options[1], options[2]);
    case Kernel::kBf16Panels:
      return bf16_panel_linear(x, *tensors[0], options[0], bias, options[1], options[2]);
#endif
#if defined(PDSERVE_INT8_PANELS)
    case Kernel::kInt8Panels:
      return int8_panel_linear(x, *tensors[0], *tensors[1], options[0], bias, options[1], options[2]);
#endif
    default: {
      py::gil_scoped_acquire python;  // run() let go of it
      return call(x).cast<torch::Tensor>();
    }
  }
}

namespace {

// services/kernels/decoder_glue.py's rms_norm over each head [*, Dh] (Qwen3's q and k norms) in the same torch
// operators, so the same values: normalized in float32, scaled in the dtype.
torch::Tensor head_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  torch::Tensor x32 = x.to(at::kFloat);
  x32 = x32 * at::rsqrt(x32.pow(2).mean(-1, true) + eps);
  return weight * x32.to(x.scalar_type());
}

}  // namespace

DecodeChain::DecodeChain(std::vector<ChainProduct> products, std::vector<torch::Tensor> post_norms,
                         std::vector<torch::Tensor> next_norms, std::vector<c10::optional<torch::Tensor>> q_norms,
                         std::vector<c10::optional<torch::Tensor>> k_norms, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double eps, double scale)
    : products_(std::move(products)), post_norms_(std::move(post_norms)), next_norms_(std::move(next_norms)),
      q_norms_(std::move(q_norms)), k_norms_(std::move(k_norms)), H_(num_heads), K_(num_kv_heads), Dh_(head_dim),
      eps_(eps), scale_(scale) {
  const size_t L = post_norms_.size();
  TORCH_CHECK(L > 0 && products_.size() == 4 * L && next_norms_.size() == L && q_norms_.size() == L &&
                  k_norms_.size() == L,
              "4 products, a post norm, a next norm and q / k norms (or None) per layer expected");
  for (size_t l = 0; l < L; ++l)
    TORCH_CHECK(q_norms_[l].has_value() == k_norms_[l].has_value(), "layer ", l, ": a q norm goes with a k norm");
  TORCH_CHECK(H_ > 0 && K_ > 0 && H_ % K_ == 0 && Dh_ > 0 && Dh_ % 2 == 0, "heads and head dim");
}

torch::Tensor DecodeChain::run(torch::Tensor h, torch::Tensor x, const torch::Tensor& kv_cache,
                               const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                               const torch::Tensor& context_lens, int64_t block_size, const torch::Tensor& cos,
                               const torch::Tensor& sin_signed) const {
  const int64_t L = static_cast<int64_t>(post_norms_.size()), N = h.size(0), KD = K_ * Dh_;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == L && kv_cache.size(1) == 2 && kv_cache.size(3) == K_ &&
                  kv_cache.size(4) == Dh_ && kv_cache.is_contiguous(),
              "kv_cache [L, 2, S, K, Dh], contiguous, expected");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == N && slot_mapping.is_contiguous(),
              "one int64 slot per row expected");
  TORCH_CHECK(h.dim() == 2 && h.sizes() == x.sizes() && h.scalar_type() == kv_cache.scalar_type(),
              "h and x [N, D] in the pool's dtype expected");
  const int64_t S = kv_cache.size(2), row_bytes = KD * kv_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(slots[n] >= 0 && slots[n] < S, "slot ", slots[n], " outside the pool");
  char* pool = static_cast<char*>(kv_cache.data_ptr());
  // The step runs without Python's lock, as torch's own operators do: an engine thread holding it for a whole step
  // (60-300 ms) would stall the event loop that streams tokens and takes requests (only "call" products take it back)
  py::gil_scoped_release no_python;
  for (int64_t l = 0; l < L; ++l) {
    const ChainProduct* p = products_.data() + 4 * l;  // qkv, o, gate_up, down
    // attention: q | k | v heads of one product; q and k rotated (together, unless each is normalized first: Qwen3),
    // k and v stored, the pool attended
    torch::Tensor qkv = p[0](x).view({N, H_ + 2 * K_, Dh_});
    torch::Tensor q = qkv.narrow(1, 0, H_), k = qkv.narrow(1, H_, K_), v = qkv.narrow(1, H_ + K_, K_);
    if (q_norms_[l].has_value()) {
      q = head_rms_norm(q, *q_norms_[l], eps_);
      k = head_rms_norm(k, *k_norms_[l], eps_);
      rotate_heads(q, cos, sin_signed);
      rotate_heads(k, cos, sin_signed);
    } else {
      torch::Tensor qk = qkv.narrow(1, 0, H_ + K_);
      rotate_heads(qk, cos, sin_signed);
    }
    for (int64_t half = 0; half < 2; ++half) {  // keys, then values: this layer's [2, S, K, Dh]
      const torch::Tensor& from = half == 0 ? k : v;  // [N, K, Dh], each row's K * Dh elements contiguous
      const char* rows = static_cast<const char*>(from.data_ptr());
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(pool + ((l * 2 + half) * S + slots[n]) * row_bytes, rows + n * from.stride(0) * from.element_size(),
                    row_bytes);
    }
    torch::Tensor o = paged_decode_attention(q, kv_cache[l], block_tables, context_lens, block_size,
                                             scale_);
    x = residual_rms_norm(h, p[1](o.view({N, H_ * Dh_})), post_norms_[l], eps_);
    // MLP: silu(gate) * up as the forward computes it (decoder_glue.py's silu_mul)
    torch::Tensor gate_up = p[2](x);
#if defined(PDSERVE_GLUE_LANES)
    torch::Tensor act = silu_mul(gate_up);
#else
    const int64_t F = gate_up.size(1) / 2;
    torch::Tensor act = at::silu(gate_up.narrow(1, 0, F)).mul_(gate_up.narrow(1, F, F));
#endif
    x = residual_rms_norm(h, p[3](act), next_norms_[l], eps_);
  }
  return x;
}
