"""Synthetic benchmark checkpoints, written once per preset under `.cache/models/<preset>` and reused."""

from __future__ import annotations

from pathlib import Path

from services.model_config import ModelConfig

CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "models"


def preset_folder(preset: str, seed: int = 0) -> Path:
    """The HF folder of `preset` (random weights drawn from `seed`), writing it on first use."""
    from services.model_presets import write_model

    folder = CACHE_DIR / (preset if seed == 0 else f"{preset}-seed{seed}")
    if not (folder / "config.json").is_file():
        print(f"writing the {preset!r} preset to {folder} (once) ...", flush=True)
        write_model(preset, folder, seed=seed)
    return folder


def describe(config: ModelConfig) -> str:
    """One line with the model's shape, e.g. `L=16 D=2048 H=32 K=8 Dh=64 F=8192 V=65536 tied`."""
    c = config
    return (f"L={c.num_layers} D={c.hidden_size} H={c.num_heads} K={c.num_kv_heads} Dh={c.head_dim} "
            f"F={c.intermediate_size} V={c.vocab_size}{' tied' if c.tie_word_embeddings else ''}, "
            f"{c.num_params / 1e9:.3f}B params")
