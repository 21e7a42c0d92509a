"""Rotary position embeddings with the checkpoint's scaling (none, linear, llama3), as HF computes them."""

from __future__ import annotations

import math

import torch

from services.model_config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """inv_freq: [head_dim // 2] float32, after any scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    assert scaling.rope_type == "llama3", scaling.rope_type
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables, indexed by absolute position.

    HF rotates as x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1). Here the sign
    is folded into the table (sin_signed = cat(-sin1, sin2)) and the halves swapped with one roll:
    cat(x2, x1) * sin_signed has the same bits (a product's sign is exact), in two kernels fewer.
    """

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh], HF's half-split layout
        self.cos = emb.cos().to(device)
        self.sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for `positions` [N], as [N, 1, Dh] in `dtype`: once per forward,
        shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, Dh] (queries and keys alike, or both at once) -> rotated, a new tensor."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
