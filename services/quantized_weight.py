"""Weight-only quantized formats for the linear layers, made on the fly from any checkpoint.

Decode reads every weight once per step, so its speed is the bytes it reads; int8 halves bf16's,
int4 (services/int4_weight.py) takes 0.625 bytes a weight. Activations, the KV cache and the KV
hand-off stay in the compute dtype: only the weights change. Except in "w8a8": the same int8 weights,
whose products on a CPU also round each activation row to int8 (dynamic, symmetric) and multiply int8 x int8
(VNNI/AMX: many-row products, i.e. prefill and batched decode, are compute-bound) — every product, whatever
its row count, so an answer never depends on how many rows shared its step. And "w4a8": int4's weights, whose
products round x to int8 per 32-column group (llama.cpp's Q4 arithmetic), stored in panels for int8 dot products
(services/w4a8_weight.py, services/kernels/w4a8_candidates.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from services.engine_config import QUANTIZATIONS
from services.int4_weight import Int4Weight
from services.w4a8_weight import W4A8Weight


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """Per-output-channel symmetric int8: w[n, k] ~= qweight[n, k] * scale[n]."""

    qweight: torch.Tensor  # [N, K] int8, values in [-127, 127]
    scale: torch.Tensor  # [N] float32
    dynamic_activations: bool = False  # "w8a8": products quantize x per row too
    rows_dropped: bool = False  # `without_rows`: `qweight` keeps its shape, not its bytes

    @classmethod
    def quantize(cls, weight: torch.Tensor, dynamic_activations: bool = False) -> Int8Weight:
        # weight: [N, K]; each row's largest magnitude maps to 127 (an all-zero row keeps scale 1)
        w = weight.float()
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(qweight.contiguous(), scale.contiguous(), dynamic_activations)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.rows().float() * self.scale[:, None]).to(dtype)  # [N, K]

    def rows(self) -> torch.Tensor:
        """`qweight`, for the torch products that read it (the native ones refuse the stub `without_rows` leaves)."""
        if self.rows_dropped:
            raise RuntimeError("this int8 weight dropped its rows (its kernels read the panel copy)")
        return self.qweight

    def without_rows(self) -> Int8Weight:
        """The same weight without its rows' bytes, for one whose every kernel reads its panel copy (int8_panels.py):
        `qweight` becomes its shape without storage, which the native kernels refuse (not contiguous) and `rows` too,
        so nothing reads zeros in its place; `scale` ([N]) stays."""
        stub = torch.zeros(1, 1, dtype=self.qweight.dtype, device=self.qweight.device).expand(self.qweight.shape)
        return dataclasses.replace(self, qweight=stub, rows_dropped=True)

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
        return dataclasses.replace(self, qweight=self.qweight.to(device), scale=self.scale.to(device))


QuantizedWeight = Int8Weight | Int4Weight  # W4A8Weight is an Int4Weight in another layout


def quantize(weight: torch.Tensor, quantization: str | None) -> torch.Tensor | QuantizedWeight:
    """`weight` in the named format (None: unchanged)."""
    if quantization is None:
        return weight
    if quantization in ("int8", "w8a8"):
        return Int8Weight.quantize(weight, dynamic_activations=quantization == "w8a8")
    if quantization == "int4":
        return Int4Weight.quantize(weight)
    if quantization == "w4a8":
        return W4A8Weight.quantize(weight)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")
