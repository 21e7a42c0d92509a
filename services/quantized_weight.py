"""Weight-only quantized formats for the linear layers, made on the fly from any checkpoint.

Decode reads every weight once per step, so its speed is the bytes it reads; int8 halves bf16's,
int4 (services/int4_weight.py) takes 0.625 bytes a weight. Activations, the KV cache and the KV
hand-off stay in the compute dtype: only the weights change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine_config import QUANTIZATIONS
from services.int4_weight import Int4Weight


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """Per-output-channel symmetric int8: w[n, k] ~= qweight[n, k] * scale[n]."""

    qweight: torch.Tensor  # [N, K] int8, values in [-127, 127]
    scale: torch.Tensor  # [N] float32

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        # weight: [N, K]; each row's largest magnitude maps to 127 (an all-zero row keeps scale 1)
        w = weight.float()
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(qweight.contiguous(), scale.contiguous())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)  # [N, K]

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.qweight.to(device), self.scale.to(device))


QuantizedWeight = Int8Weight | Int4Weight


def quantize(weight: torch.Tensor, quantization: str | None) -> torch.Tensor | QuantizedWeight:
    """`weight` in the named format (None: unchanged)."""
    if quantization is None:
        return weight
    if quantization == "int8":
        return Int8Weight.quantize(weight)
    if quantization == "int4":
        return Int4Weight.quantize(weight)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")
