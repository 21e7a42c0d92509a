"""Test helper: a Hugging Face model folder written as a GGUF file with the `gguf` package, laid out the way
llama.cpp's convert_hf_to_gguf.py lays a Llama out (q/k rows permuted to interleaved rotary pairs, the
byte-level BPE vocabulary as `tokenizer.ggml.*`), so the tests need no download."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from services.model_config import ModelConfig

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: HF's half-split rotary rows -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def sentencepiece_vocab(num_pieces: int = 200) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece BPE vocabulary as Llama 2's GGUFs hold one: <unk>, <s>,
    </s>, the 256 byte tokens, then pieces (`▁` for a space) learned from the presets' corpus, scored by rank."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from services.preset_tokenizer import _CORPUS

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    learner.train_from_iterator(_CORPUS.splitlines(), trainers.BpeTrainer(vocab_size=num_pieces, show_progress=False))
    vocab = learner.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # unknown, control, byte, normal
    return tokens, scores, types


def write_gguf(folder: Path, out: Path, *, arch: str = "llama", matrix_type=F32, skip: tuple[str, ...] = (),
               tokenizer_model: str = "gpt2", tensor_types: dict | None = None) -> Path:
    """`folder` (one model.safetensors, a byte-level BPE tokenizer.json) as a GGUF at `out`, its matrices in
    `matrix_type` but those whose GGUF names contain a key of `tensor_types` (e.g. {"ffn_down": Q8_0}: llama.cpp's
    Q4_K_M mixes types so) in its type; `skip` leaves those metadata keys out; tokenizer_model "llama" writes
    `sentencepiece_vocab()` instead of the folder's."""
    c = ModelConfig.from_folder(folder)
    weights = load_file(str(folder / "model.safetensors"))
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    values = {
        f"{arch}.context_length": (writer.add_uint32, c.max_position_embeddings),
        f"{arch}.embedding_length": (writer.add_uint32, c.hidden_size),
        f"{arch}.block_count": (writer.add_uint32, c.num_layers),
        f"{arch}.feed_forward_length": (writer.add_uint32, c.intermediate_size),
        f"{arch}.attention.head_count": (writer.add_uint32, c.num_heads),
        f"{arch}.attention.head_count_kv": (writer.add_uint32, c.num_kv_heads),
        f"{arch}.rope.dimension_count": (writer.add_uint32, c.head_dim),
        f"{arch}.rope.freq_base": (writer.add_float32, c.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": (writer.add_float32, c.rms_norm_eps),
        f"{arch}.vocab_size": (writer.add_uint32, c.vocab_size),
        "general.file_type": (writer.add_uint32, 0 if matrix_type == F32 else 7),
        "tokenizer.ggml.model": (writer.add_string, tokenizer_model),
        "tokenizer.ggml.pre": (writer.add_string, "default"),
        "tokenizer.ggml.bos_token_id": (writer.add_uint32, c.bos_token_id),
        "tokenizer.ggml.eos_token_id": (writer.add_uint32, c.eos_token_ids[0]),
        "tokenizer.ggml.eot_token_id": (writer.add_uint32, c.eos_token_ids[-1]),
        "tokenizer.ggml.add_bos_token": (writer.add_bool, tokenizer_config["add_bos_token"]),
        "tokenizer.chat_template": (writer.add_string, tokenizer_config["chat_template"]),
    }
    if tokenizer_model == "llama":  # <s> and </s>, no end-of-turn token
        values["tokenizer.ggml.bos_token_id"], values["tokenizer.ggml.eos_token_id"] = (writer.add_uint32, 1), (writer.add_uint32, 2)
        del values["tokenizer.ggml.eot_token_id"], values["tokenizer.ggml.add_bos_token"]
    for key, (add, value) in values.items():
        if key not in skip:
            add(key, value)
    if tokenizer_model == "llama":
        tokens, scores, types = sentencepiece_vocab()
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
    else:
        vocab = tokenizer["model"]["vocab"]
        special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
        writer.add_token_list(sorted(vocab, key=vocab.get))
        writer.add_token_types([3 if i in special else 1 for i in range(len(vocab))])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])

    def add(name: str, hf_name: str, num_heads: int | None = None) -> None:
        w = weights[hf_name].astype(np.float32)
        if num_heads is not None and arch == "llama":
            w = permute(w, num_heads)
        kind = next((t for part, t in (tensor_types or {}).items() if part in name), matrix_type)
        if w.ndim == 2 and kind != F32:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, w)

    add("token_embd.weight", "model.embed_tokens.weight")
    add("output_norm.weight", "model.norm.weight")
    if not c.tie_word_embeddings:
        add("output.weight", "lm_head.weight")
    for i in range(c.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", p + "input_layernorm.weight")
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", c.num_heads)
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", c.num_kv_heads)
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight")
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight")
        add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight")
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight")
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
