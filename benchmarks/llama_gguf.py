"""A GGUF file of a Llama-family Hugging Face folder's exact weights, for llama.cpp to run beside
pdserve on the same model (`benchmarks/vs_llama_cpp.py`). Written with the `gguf` package, the way
llama.cpp's own converter lays a Llama out: q/k rows permuted back to interleaved rotary pairs,
norms in float32, matrices in the chosen type (F16, Q8_0, and every matrix Q4_0: `q4_0-pure`).
`q4_0` and `q4_k_m` are what a llama.cpp user has: the f16 file through llama.cpp's own quantizer with its defaults
(`llama-quantize model-f16.gguf Q4_0`, which keeps the output matrix, here the tied embedding, in Q6_K; `Q4_K_M`,
Q4_K with half the `ffn_down` and `attn_v` matrices in Q6_K, llama.cpp users' usual 4-bit choice).

The vocabulary is placeholder text (the benchmark feeds token ids, never text): `<unk>`, `<s>`,
`</s>`, the 256 byte tokens llama.cpp's SentencePiece loader looks up, then `<t{i}>`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from services.checkpoint import load_weights
from services.model_config import ModelConfig

TYPES = ("f16", "q8_0", "q4_0", "q4_0-pure", "q4_k_m")
BY_LLAMA_QUANTIZE = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}  # the types llama.cpp's own quantizer writes from the f16


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # HF's half-split rotary rows -> llama.cpp's interleaved pairs (the inverse of HF's converter)
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_file(folder: str | Path, cache: str | Path, qtype: str) -> Path:
    """The GGUF of `qtype` for the model in `folder`, written under `cache` on first use (`1b-q4_0.gguf` of sessions
    before 45 was every matrix Q4_0: the name now says `-pure`)."""
    if qtype not in TYPES:
        raise ValueError(f"qtype must be one of {', '.join(TYPES)}, got {qtype!r}")
    cache, stem = Path(cache), Path(folder).name
    if qtype in BY_LLAMA_QUANTIZE:
        return quantize_like_llama_cpp(gguf_file(folder, cache, "f16"), cache / f"{stem}-{qtype}-llama-quantize.gguf",
                                       BY_LLAMA_QUANTIZE[qtype])
    return write_gguf(folder, cache / f"{stem}-{qtype}.gguf", qtype)


def quantize_like_llama_cpp(source: Path, out: Path, ftype: str = "Q4_0") -> Path:
    """`source` through llama.cpp's quantizer with its default settings, to `ftype` (a LLAMA_FTYPE_MOSTLY_ name: Q4_0,
    Q8_0, Q4_K_M, ...; llama-cpp-python's binding of `llama_model_quantize`, the function behind `llama-quantize`;
    an already quantized source is re-quantized, as `llama-quantize --allow-requantize`); its per-tensor log goes to
    `out`.log."""
    import llama_cpp

    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), os.cpu_count() or 1
    params.allow_requantize = True
    tmp = out.with_suffix(".tmp")
    with open(out.with_suffix(".log"), "w") as log:  # the C library writes a line a tensor to fd 2
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            failed = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if failed:
        raise RuntimeError(f"llama.cpp's quantizer failed ({failed}) on {source}: see {out.with_suffix('.log')}")
    tmp.rename(out)
    return out


def write_gguf(folder: str | Path, out: str | Path, qtype: str) -> Path:
    import gguf

    if qtype not in TYPES or qtype in BY_LLAMA_QUANTIZE:
        raise ValueError(f"write_gguf writes {', '.join(t for t in TYPES if t not in BY_LLAMA_QUANTIZE)}, got {qtype!r}")
    out = Path(out)
    if out.is_file():
        return out
    c = ModelConfig.from_folder(folder)
    matrix_type = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
                   "q4_0-pure": gguf.GGMLQuantizationType.Q4_0}[qtype]
    weights = load_weights(folder, c, torch.float32)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"<t{i}>" for i in range(len(tokens), c.vocab_size)]
    types = [2, 3, 3] + [6] * 256 + [1] * (c.vocab_size - 259)  # unknown, control, byte, normal
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * c.vocab_size)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, tensor: torch.Tensor, matrix: bool = True) -> None:
        data = tensor.numpy()
        if matrix and matrix_type != gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, gguf.quants.quantize(data, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(name, data.astype(np.float16) if matrix else data.astype(np.float32))

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"], matrix=False)
    if not c.tie_word_embeddings:
        add("output.weight", weights["lm_head.weight"])
    for i in range(c.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", weights[p + "input_layernorm.weight"], matrix=False)
        add(b + "attn_q.weight", torch.from_numpy(_permute(weights[p + "self_attn.q_proj.weight"].numpy(), c.num_heads)))
        add(b + "attn_k.weight", torch.from_numpy(_permute(weights[p + "self_attn.k_proj.weight"].numpy(),
                                                           c.num_kv_heads)))
        add(b + "attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        add(b + "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"], matrix=False)
        add(b + "ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        add(b + "ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        add(b + "ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out
