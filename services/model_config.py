"""The model's shape, read from a Hugging Face `config.json` and validated (imports no torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.config_fields import flag, positive_float, positive_int, read_json, token_ids
from services.errors import CheckpointError
from services.gguf_folder import resolve_folder
from services.rope_scaling import RopeScaling, read_rope

# HF `architectures` value -> our family name. Everything else is refused by name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a decoder-only Llama-family checkpoint."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    torch_dtype: str  # dtype the checkpoint was saved in: "float32" | "bfloat16" | "float16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mistral's attention window. The runtime does not implement windowed attention; it caps
    # max_model_len at this value instead, which is exact while sequences fit in the window.
    sliding_window: int | None = None

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrix products: q, k, v, o and the gated MLP's three."""
        d, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        return d * q + 2 * d * kv + q * d + 3 * d * self.intermediate_size

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        kv, q = self.num_kv_heads * self.head_dim, self.num_heads * self.head_dim
        biases = q + 2 * kv if self.attention_bias else 0
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (self.layer_matmul_params + biases + norms) + embed + self.hidden_size

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        """Validate a parsed `config.json`; every refusal names the field and the value."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        arch = _architecture(raw, source)
        hidden = positive_int(raw, "hidden_size", source)
        heads = positive_int(raw, "num_attention_heads", source)
        kv_heads = positive_int(raw, "num_key_value_heads", source, default=heads)
        if heads % kv_heads:
            raise CheckpointError(f"{source}: field 'num_attention_heads' ({heads}) is not divisible by "
                                  f"'num_key_value_heads' ({kv_heads})")
        if raw.get("head_dim") is None and hidden % heads:
            raise CheckpointError(f"{source}: field 'hidden_size' ({hidden}) is not divisible by "
                                  f"'num_attention_heads' ({heads})")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is supported")
        if flag(raw, "mlp_bias", source, default=False):
            raise CheckpointError(f"{source}: field 'mlp_bias' is true; MLP biases are not supported")
        if arch == "qwen2":
            attention_bias = True  # Qwen2 always biases q/k/v (never o); the config has no switch
        elif arch == "mistral":
            attention_bias = False  # HF's Mistral ignores the field
        elif flag(raw, "attention_bias", source, default=False):
            raise CheckpointError(f"{source}: field 'attention_bias' is true for {arch}, which also biases "
                                  "o_proj; only Qwen2's q/k/v bias is supported")
        else:
            attention_bias = False
        vocab = positive_int(raw, "vocab_size", source)
        rope_theta, rope_scaling = read_rope(raw, source)
        dtype_key = "torch_dtype" if raw.get("torch_dtype") is not None else "dtype"  # transformers 5 writes "dtype"
        dtype = raw.get(dtype_key) or "float32"
        if dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"{source}: field {dtype_key!r} is {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
        eos = token_ids(raw.get("eos_token_id"), "eos_token_id", vocab, source)
        bos = token_ids(raw.get("bos_token_id"), "bos_token_id", vocab, source)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=positive_int(raw, "intermediate_size", source),
            num_layers=positive_int(raw, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=positive_int(raw, "head_dim", source, default=hidden // heads),
            rms_norm_eps=positive_float(raw, "rms_norm_eps", source, default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=positive_int(raw, "max_position_embeddings", source, default=2048),
            tie_word_embeddings=flag(raw, "tie_word_embeddings", source, default=False),
            attention_bias=attention_bias,
            qk_norm=arch == "qwen3",
            torch_dtype=dtype,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=eos,
            sliding_window=_sliding_window(raw, arch, source),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """Read `config.json`, then let `generation_config.json` (if present) override bos/eos ids.
        A `.gguf` file's converted folder is read in its place (services/gguf_folder.py)."""
        folder = resolve_folder(path)
        config_path = folder / "config.json"
        config = cls.from_hf_dict(read_json(config_path), source=str(config_path))
        gen_path = folder / "generation_config.json"
        if not gen_path.is_file():
            return config
        gen = read_json(gen_path)
        if not isinstance(gen, dict):
            raise CheckpointError(f"{gen_path}: expected a JSON object, got {type(gen).__name__}")
        updates: dict[str, Any] = {}
        for key, field in (("eos_token_id", "eos_token_ids"), ("bos_token_id", "bos_token_id")):
            if gen.get(key) is not None:
                ids = token_ids(gen[key], key, config.vocab_size, str(gen_path))
                updates[field] = ids if field == "eos_token_ids" else ids[0] if ids else None
        return dataclasses.replace(config, **updates)


def _architecture(raw: dict, source: str) -> str:
    names = raw.get("architectures")
    if not names:
        # A config saved on its own (`LlamaConfig().save_pretrained`) carries only `model_type`.
        model_type = raw.get("model_type")
        if model_type in SUPPORTED_ARCHITECTURES.values():
            return model_type
        raise CheckpointError(f"{source}: field 'architectures' is missing and 'model_type' is {model_type!r}")
    if not isinstance(names, list) or names[0] not in SUPPORTED_ARCHITECTURES:
        name = names[0] if isinstance(names, list) else names
        raise CheckpointError(f"{source}: field 'architectures' names {name!r}, which is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return SUPPORTED_ARCHITECTURES[names[0]]


def _sliding_window(raw: dict, arch: str, source: str) -> int | None:
    if arch in ("qwen2", "qwen3"):
        # Qwen configs carry a `sliding_window` value that is only used when this switch is on.
        if flag(raw, "use_sliding_window", source, default=False):
            raise CheckpointError(f"{source}: field 'use_sliding_window' is true; sliding-window Qwen is not supported")
        return None
    if arch != "mistral" or raw.get("sliding_window") is None:
        return None
    return positive_int(raw, "sliding_window", source)
