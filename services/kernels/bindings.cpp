// The Python names of the native kernels (each defined, with its shapes, in its own file).
#include <torch/extension.h>

#include "decode_chain.h"
#include "glue_lanes.h"

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                            const c10::optional<torch::Tensor>& bias, int64_t rows, bool non_temporal, bool parts);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     int64_t block_size, double scale);
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
                                int64_t context_len, int64_t block_size, double scale);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low, const c10::optional<torch::Tensor>& bias, int64_t streams,
                          bool non_temporal);
torch::Tensor int4_panel_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                                const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias,
                                int64_t streams, bool non_temporal);
torch::Tensor bf16_panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                                const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal);
torch::Tensor int8_panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                int64_t N, const c10::optional<torch::Tensor>& bias, int64_t streams,
                                bool non_temporal);
torch::Tensor int8_panel_dequantize(const torch::Tensor& panels, int64_t N, torch::Tensor out);
torch::Tensor int8_panel_bf16_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                     int64_t N, const c10::optional<torch::Tensor>& bias, int64_t streams,
                                     bool non_temporal);
torch::Tensor int8_panel_pairs_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                      int64_t N, const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_panel_tiled_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                      int64_t N, const c10::optional<torch::Tensor>& bias);
torch::Tensor int4_panel_tiled_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                                      const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias);
torch::Tensor int4_panel_dequantize(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low,
                                    int64_t N, torch::Tensor out);
torch::Tensor int4_tiled_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                                const torch::Tensor& low, const c10::optional<torch::Tensor>& bias);
torch::Tensor int4_x16_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                               const torch::Tensor& low, const c10::optional<torch::Tensor>& bias, int64_t streams,
                               bool non_temporal);
torch::Tensor int8_x16_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal);
torch::Tensor tiled_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                           const c10::optional<torch::Tensor>& bias);
torch::Tensor pair_tiled_linear(const torch::Tensor& x, const c10::optional<torch::Tensor>& w,
                                const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& packed,
                                const c10::optional<torch::Tensor>& low, const c10::optional<torch::Tensor>& bias);
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                         const c10::optional<torch::Tensor>& low, const c10::optional<torch::Tensor>& bias);
bool amx_ready();
torch::Tensor amx_w8a8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias);
bool set_decode_attention_tiles(bool on);
bool set_prefill_attention_tiles(bool on);
torch::Tensor argmax_rows(const torch::Tensor& logits);
#if defined(__x86_64__) || defined(__i386__)
void flush_cache_lines(const torch::Tensor& t);
#endif
torch::Tensor w4a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& low, int64_t N, const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_digits_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                 const c10::optional<torch::Tensor>& bias);
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor w8a8_panel_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& bias);
torch::Tensor w8a8_row_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias, int64_t streams, bool non_temporal);
std::tuple<torch::Tensor, torch::Tensor> w8a8_round_rows(const torch::Tensor& x);
torch::Tensor w8a8_scale_products(const torch::Tensor& dots, const torch::Tensor& xs, const torch::Tensor& scale,
                                  const c10::optional<torch::Tensor>& bias, const torch::Tensor& like);
torch::Tensor int4_dequantize(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& low,
                              torch::Tensor out);

torch::Tensor residual_rms_norm(torch::Tensor& h, const c10::optional<torch::Tensor>& delta,
                                const torch::Tensor& weight, double eps);
void rotate_heads(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "y[M, N] = x[M, K] @ w[N, K]^T (* scale[N]) (+ bias[N]), few rows of x",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"), py::arg("rows") = 1,
        py::arg("non_temporal") = false, py::arg("parts") = false);
  m.def("int4_linear", &int4_linear,
        "y[M, N] = x[M, K] @ W^T (+ bias[N]), W group-wise int4 (int4_weight.py); with bf16 x on AVX512-BF16 CPUs "
        "each thread reads its W rows as `streams` (1-4) parts, prefetched into the caches or past them (non_temporal)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("low"), py::arg("bias"), py::arg("streams") = 1,
        py::arg("non_temporal") = false);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  m.attr("int4_linear_reads_parts") = true;  // the kernel plan times its streams and prefetch variants
#else
  m.attr("int4_linear_reads_parts") = false;
#endif
  m.def("int4_tiled_linear", &int4_tiled_linear, "int4_linear for several rows: W dequantized 16 rows at a time");
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  m.def("int4_x16_linear", &int4_x16_linear,
        "int4_linear with x as int16 per 32-column group (integer multiply-adds; AVX2 CPUs); each thread reads its W "
        "rows as `streams` (1-4) parts, together for one x row, else in turn, prefetched into the caches or past them "
        "(non_temporal)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("low"), py::arg("bias"), py::arg("streams") = 1,
        py::arg("non_temporal") = false);
  m.def("int8_x16_linear", &int8_x16_linear,
        "y[M, N] = x @ (w * scale)^T (+ bias), x as int16 per 32-column group (integer multiply-adds; AVX2 CPUs); "
        "each thread reads its W rows as `streams` (1-4) parts, together for one x row, else in turn, prefetched into "
        "the caches or past them (non_temporal)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"), py::arg("streams") = 1,
        py::arg("non_temporal") = false);
  m.def("tiled_linear", &tiled_linear,
        "y[M, N] = x[M, K] @ w[N, K]^T (* scale[N]) (+ bias[N]) in float32 for batches, W read once in 16-row panels "
        "(AVX2 CPUs)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"));
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  m.def("int4_panel_linear", &int4_panel_linear,
        "y[M, N] = x[M, K] (bf16) @ W^T (+ bias[N]), W group-wise int4 in 16-row panels (int4_panels.py's copy of an "
        "Int4Weight), bf16 products (vdpbf16ps); for one x row each thread reads its panels as `streams` (1, 2 or 4) "
        "parts, prefetched into the caches or past them (non_temporal) (AVX512-BF16 CPUs)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("low"), py::arg("out_features"), py::arg("bias"),
        py::arg("streams") = 1, py::arg("non_temporal") = false);
  m.def("bf16_panel_linear", &bf16_panel_linear,
        "y[M, N] = x[M, K] (bf16) @ W^T (+ bias[N]), W bf16 in 16-row panels of column pairs (bf16_panels.py's copy of "
        "a dense weight), any row count; for one x row each thread reads its panels as `streams` (1, 2 or 4) parts, "
        "prefetched into the caches or past them (non_temporal) (AVX512-BF16 CPUs)",
        py::arg("x"), py::arg("panels"), py::arg("out_features"), py::arg("bias"), py::arg("streams") = 1,
        py::arg("non_temporal") = false);
  m.def("int4_panel_dequantize", &int4_panel_dequantize,
        "W from the panel copy of a group-wise int4 weight (int4_panels.py), into out [N, K] bf16: prefill's dense "
        "product without the row layout (AVX512-BF16 CPUs)",
        py::arg("packed"), py::arg("scale"), py::arg("low"), py::arg("out_features"), py::arg("out"));
  m.def("pair_tiled_linear", &pair_tiled_linear,
        "y[M, N] = x[M, K] (bf16) @ W^T (+ bias[N]) for batches, W bf16 (w), int8 (w, scale [N]) or group-wise int4 "
        "(packed, scale, low): W converted once a call into bf16 pair panels, vdpbf16ps register tiles "
        "(AVX512-BF16 CPUs)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("packed"), py::arg("low"), py::arg("bias"));
  m.def("int8_panel_pairs_linear", &int8_panel_pairs_linear,
        "pair_tiled_linear's product for a weight-only int8 weight, bit for bit, from its panel copy (int8_panels.py: "
        "panels, scale) instead of its rows (AVX512-BF16 CPUs)",
        py::arg("x"), py::arg("panels"), py::arg("scale"), py::arg("out_features"), py::arg("bias"));
  m.def("int8_panel_tiled_linear", &int8_panel_tiled_linear,
        "pair_tiled_linear's product for a weight-only int8 weight, bit for bit, from its panel copy (int8_panels.py: "
        "panels, scale) for many rows: two panels converted into bf16 pairs a pass, the bf16 panels' register tiles "
        "over every row (AVX512-BF16 CPUs)",
        py::arg("x"), py::arg("panels"), py::arg("scale"), py::arg("out_features"), py::arg("bias"));
  m.def("int4_panel_tiled_linear", &int4_panel_tiled_linear,
        "pair_tiled_linear's product for a group-wise int4 weight, bit for bit, from its panel copy (int4_panels.py: "
        "packed, scale, low) for many rows, as int8_panel_tiled_linear (AVX512-BF16 CPUs)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("low"), py::arg("out_features"), py::arg("bias"));
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  m.def("int8_panel_linear", &int8_panel_linear,
        "y[M, N] = x[M, K] (bf16) @ (W * scale)^T (+ bias[N]), W per-channel int8 in 16-row panels (int8_panels.py's "
        "copy of an Int8Weight), x in 21-bit fixed point as three int8 digit rows (int8_digits_linear's product bit "
        "for bit); for one x row each thread reads its panels as `streams` (1, 2 or 4) parts, prefetched into the "
        "caches or past them (non_temporal) (AVX512-VNNI CPUs)",
        py::arg("x"), py::arg("panels"), py::arg("scale"), py::arg("out_features"), py::arg("bias"),
        py::arg("streams") = 1, py::arg("non_temporal") = false);
  m.def("int8_panel_dequantize", &int8_panel_dequantize,
        "W's int8 values (exact, as bf16) from the panel copy of a weight-only int8 weight (int8_panels.py) into out "
        "[N, K]: prefill's dense product without the rows (AVX512-VNNI CPUs)",
        py::arg("panels"), py::arg("out_features"), py::arg("out"));
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  m.def("int8_panel_bf16_linear", &int8_panel_bf16_linear,
        "y[M, N] = x[M, K] (bf16) @ (W * scale)^T (+ bias[N]) for several rows, W per-channel int8 from its panel copy "
        "(int8_panels.py) as bf16 pairs in float32 sums; up to 4 rows, each thread's panels read as `streams` (1 or 2) "
        "parts, prefetched into the caches or past them (non_temporal) (AVX512-BF16 and VBMI CPUs)",
        py::arg("x"), py::arg("panels"), py::arg("scale"), py::arg("out_features"), py::arg("bias"),
        py::arg("streams") = 1, py::arg("non_temporal") = false);
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  m.def("amx_linear", &amx_linear,
        "y[M, N] = x[M, K] (bf16) @ W^T (+ bias[N]) for batches, W bf16 (w), int8 (w, scale [N]) or group-wise int4 "
        "(w: packed, scale, low), K a multiple of 32: W's rows loaded as tiles where they lie, tdpbf16ps (CPUs with AMX)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("low"), py::arg("bias"));
  m.def("amx_ready", &amx_ready, "whether this process holds the CPU's tile state (asks Linux for it once)");
  m.def("set_prefill_attention_tiles", &set_prefill_attention_tiles,
        "prefill attention's products on the tile unit (AMX) or not; returns the previous setting (False: not built)");
  m.def("set_decode_attention_tiles", &set_decode_attention_tiles,
        "paged_decode_attention's bf16 path on the tile unit (AMX) on or off for this process; returns the old value");
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  m.def("amx_w8a8_linear", &amx_w8a8_linear,
        "w8a8_linear bit for bit (x rounded per row, int8 W, exact int32 products) with the products on the tile unit "
        "(tdpbssd; CPUs with AMX), K a multiple of 64",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"));
#endif
#if defined(__x86_64__) || defined(__i386__)
  m.def("flush_cache_lines", &flush_cache_lines,
        "t's bytes flushed out of every cache level (clflushopt): a weight in memory, as a decode step reads it");
#endif
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, dim=-1) of float32 logits [M, V], the rows over the threads");
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
  m.def("w4a8_linear", &w4a8_linear,
        "y[M, N] = x_q[M, K] @ W^T (+ bias[N]), W group-wise int4 in 16-row panels (w4a8_weight.py), x rounded to "
        "int8 per 32-column group (w4a8_candidates.py), the products exact in int32 (vpdpbusd on AVX512-VNNI CPUs, "
        "vpmaddubsw on AVX2 ones), scaled per group",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("low"), py::arg("out_features"), py::arg("bias"));
  m.def("int8_digits_linear", &int8_digits_linear,
        "y[M, N] = x @ (w * scale)^T (+ bias[N]), weight-only int8: x in 21-bit fixed point per row as three int8 "
        "digit rows (x_digits.h), exact int32 dots by w8a8's register tiles (vpdpbusd on AVX512-VNNI CPUs, "
        "vpmaddubsw on AVX2 ones), joined in int64, then float32",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"));
  m.def("w8a8_linear", &w8a8_linear,
        "y[M, N] = x_q[M, K] @ (w * scale)^T (+ bias[N]), x rounded to int8 per row, the products exact in int32 "
        "(vpdpbusd on AVX512-VNNI CPUs, vpmaddubsw on AVX2 ones): linear_candidates._int8_dynamic_mm bit for bit",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"));
#endif
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
  m.def("w8a8_round_rows", &w8a8_round_rows,
        "x [M, K] -> (xq int8 [M, K], xs float32 [M, 1]): each row rounded to int8 with its own scale, as "
        "linear_candidates._int8_dynamic_mm rounds it (w8a8_matmul_parts.cpp)", py::arg("x"));
  m.def("w8a8_scale_products", &w8a8_scale_products,
        "int32 products [M, N] -> float(dots) * xs[m] * scale[n] (+ bias) in like's dtype, in one pass (torch's "
        "operators' roundings)", py::arg("dots"), py::arg("xs"), py::arg("scale"), py::arg("bias"), py::arg("like"));
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def("w8a8_panel_linear", &w8a8_panel_linear,
        "w8a8_linear's product bit for bit by other register tiles (w8a8_x_panels.h): x packed into 16-row panels, "
        "W's rows broadcast four bytes at a time; for many rows (AVX512-VNNI CPUs)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"));
  m.def("w8a8_row_linear", &w8a8_row_linear,
        "w8a8_linear's product bit for bit with W streamed row by row, as `streams` parts (1, 2 or 4) read together, "
        "prefetched past the caches (non_temporal) or into them; for one row of x (AVX512-VNNI CPUs)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"), py::arg("streams"), py::arg("non_temporal"));
#endif
  m.def("int4_dequantize", &int4_dequantize, "W from group-wise int4, into out [N, in_features] (its dtype)");
  m.def("prefill_attention", &prefill_attention,
        "one sequence's T new tokens, causally over its context in the paged pool (in place)");
  m.def("residual_rms_norm", &residual_rms_norm, "h += delta (in place; delta may be None), then RMSNorm(h) * weight",
        py::arg("h"), py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("rotate_heads", &rotate_heads, "x [N, P, Dh] rotated in place by cos and sign-folded sin [N, Dh]");
#if defined(PDSERVE_GLUE_LANES)
  m.def("silu_mul", &silu_mul, "gate_up [N, 2F] -> silu(gate) * up [N, F], each rounded to the dtype (decoder_glue.cpp)");
#endif
  m.def("paged_decode_attention", &paged_decode_attention, "one query per sequence over the paged pool, in place");
  py::class_<ChainProduct>(m, "ChainProduct", "one product of a DecodeChain: a native kernel, or a Python call")
      .def(py::init<std::string, std::vector<c10::optional<torch::Tensor>>, c10::optional<torch::Tensor>,
                    std::vector<int64_t>, py::object>(),
           py::arg("kernel"), py::arg("tensors"), py::arg("bias"), py::arg("options"), py::arg("call"));
  py::class_<DecodeChain>(m, "DecodeChain", "a decode step's decoder layers in one call (decode_chain.cpp)")
      .def(py::init<std::vector<ChainProduct>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<c10::optional<torch::Tensor>>, std::vector<c10::optional<torch::Tensor>>, int64_t,
                    int64_t, int64_t, double, double>(),
           py::arg("products"), py::arg("post_norms"), py::arg("next_norms"), py::arg("q_norms"), py::arg("k_norms"),
           py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("run", &DecodeChain::run, "-> x after the last layer; h updated in place", py::arg("h"), py::arg("x"),
           py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"),
           py::arg("block_size"), py::arg("cos"), py::arg("sin_signed"));
}
