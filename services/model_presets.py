"""Synthetic Llama checkpoints (random weights, a real byte-level BPE tokenizer) written as HF folders."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from services.cache_folder import cache_root
from services.model_config import SUPPORTED_DTYPES, ModelConfig, RopeScaling
from services.preset_tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    GENERATION_EOS_IDS,
    SPECIAL_TOKENS,
    build_tokenizer,
)


@dataclass(frozen=True)
class ModelPreset:
    """The shape of one synthetic Llama checkpoint and how its weights are drawn and saved."""

    name: str
    vocab_size: int  # rows of the embedding; those past the tokenizer's vocabulary are zero padding
    tokenizer_vocab_size: int  # <= vocab_size
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    dtype: str  # default save dtype
    init_std: float  # std of the random matrices (norm weights are ones)
    output_std: float  # std of lm_head (the embedding when tied); larger peaks next-token distributions
    max_shard_bytes: int | None  # None: one model.safetensors

    def hf_config(self, dtype: str | None = None) -> dict:
        """The `config.json` contents, in the legacy `rope_theta`/`rope_scaling` form that every
        transformers version reads."""
        scaling = None if self.rope_scaling is None else asdict(self.rope_scaling)
        if scaling is not None and scaling["rope_type"] != "llama3":
            scaling = {"rope_type": scaling["rope_type"], "factor": scaling["factor"]}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": self.init_std,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "torch_dtype": dtype or self.dtype,
        }

    def model_config(self) -> ModelConfig:
        """The ModelConfig of this preset, without writing anything (eos as generation_config sets it)."""
        config = ModelConfig.from_hf_dict(self.hf_config(), source=f"preset {self.name!r}")
        return replace(config, eos_token_ids=GENERATION_EOS_IDS)


PRESETS: dict[str, ModelPreset] = {
    # The default test model. Std 0.15 in the body and 0.5 on lm_head put the median top-1 probability
    # near 0.4 (0.035 with 0.15 everywhere). llama3 rope scaling with a short original context puts its
    # 8 rotary frequencies in all three bands (kept, smoothed, scaled), so golden tests cover each.
    "tiny": ModelPreset(
        name="tiny", vocab_size=512, tokenizer_vocab_size=500, hidden_size=64, intermediate_size=256,
        num_layers=4, num_heads=4, num_kv_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 256), tie_word_embeddings=False,
        dtype="float32", init_std=0.15, output_std=0.5, max_shard_bytes=None),
    # GPT-2-small-sized (124.7M parameters), for CPU and small-GPU benchmarks.
    "small": ModelPreset(
        name="small", vocab_size=32000, tokenizer_vocab_size=32000, hidden_size=768, intermediate_size=2048,
        num_layers=12, num_heads=12, num_kv_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=False,
        dtype="float32", init_std=0.02, output_std=0.02, max_shard_bytes=None),
    # Llama-3.2-1B-shaped with half its vocabulary (1.107B parameters), sharded like a hub checkpoint.
    "1b": ModelPreset(
        name="1b", vocab_size=65536, tokenizer_vocab_size=65536, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), tie_word_embeddings=True,
        dtype="bfloat16", init_std=0.02, output_std=0.02, max_shard_bytes=2 * 10**9),
}


def write_model(preset: str, out_dir: str | Path, seed: int = 0, dtype: str | None = None,
                max_shard_bytes: int | None = None) -> Path:
    """Write a complete HF folder for `preset` at `out_dir` (replacing it), atomically.

    `dtype` and `max_shard_bytes` default to the preset's; weights are drawn in float32 from a
    generator seeded with `seed`, then cast, so every dtype of one seed holds the same model.
    """
    out = Path(out_dir)
    tmp = _write_to_temp(_preset(preset), out, seed, dtype, max_shard_bytes)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def default_model_dir() -> Path:
    """Where the default tiny model lives: `$PDSERVE_CACHE` or ~/.cache/pdserve, then models/tiny-seed0."""
    return cache_root() / "models" / "tiny-seed0"


def ensure_default_model() -> Path:
    """Return the default tiny model's folder, writing it on first use (safe to race from many processes)."""
    out = default_model_dir()
    if (out / "config.json").is_file():
        return out
    tmp = _write_to_temp(_preset("tiny"), out, seed=0, dtype=None, max_shard_bytes=None)
    try:
        os.rename(tmp, out)  # fails if another process published first; its folder is identical
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return out


def _preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def _write_to_temp(preset: ModelPreset, out: Path, seed: int, dtype: str | None, max_shard_bytes: int | None) -> Path:
    """Write the whole folder into a fresh sibling of `out`, so a crash never leaves half a folder there."""
    dtype = dtype or preset.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the published folder should read like any other
        config = preset.hf_config(dtype)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": list(GENERATION_EOS_IDS)})
        build_tokenizer(preset.tokenizer_vocab_size).save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(preset))
        max_shard_bytes = max_shard_bytes or preset.max_shard_bytes
        _write_weights(tmp, preset, ModelConfig.from_hf_dict(config), seed, max_shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _tokenizer_config(preset: ModelPreset) -> dict:
    bos, eos = SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOS_ID]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": eos,
            "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": preset.max_position_embeddings, "chat_template": CHAT_TEMPLATE}


def _write_weights(folder: Path, preset: ModelPreset, config: ModelConfig, seed: int, max_shard_bytes: int | None) -> None:
    """Draw every tensor in `expected_shapes` order and save them in shards of at most `max_shard_bytes`."""
    # torch is imported here, not at the top: the router calls ensure_default_model and imports no torch.
    import torch
    from safetensors.torch import save_file

    from services.checkpoint import INDEX_FILE, SINGLE_FILE, expected_shapes

    dtype = getattr(torch, config.torch_dtype)
    item_size = torch.empty((), dtype=dtype).element_size()
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    shard_bytes = 0
    for name, shape in expected_shapes(config).items():
        size = item_size * math.prod(shape)
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = shape
        shard_bytes += size
    output_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard.items():
            weight_map[name] = file
            if len(shape) == 1:  # norm weights
                tensors[name] = torch.ones(shape, dtype=dtype)
                continue
            std = preset.output_std if name == output_name else preset.init_std
            weight = torch.randn(shape, generator=generator) * std
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                weight[preset.tokenizer_vocab_size :] = 0  # padding rows: never the argmax, never looked up
            tensors[name] = weight.to(dtype)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(item_size * math.prod(s) for shard in shards for s in shard.values())
        _write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
