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
from services.int4_weight import Int4Weight, on_four_bit_grid, spread_rows
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


class FileFormats:
    """The format each matrix takes under a weight-only quantization: the one asked for, except in a model whose file
    already holds some projections in 4 bits — a GGUF's Q4_0 / Q4_1 / Q4_K matrices, read as float32 on a CPU
    (checkpoint.load_weights with `quantizing`) — where the file's own values decide per matrix, as llama.cpp's 4-bit
    files mix 4 and 6-8 bits: under int4 / w4a8 a matrix that int8 holds closer than int4 (one the file keeps wider:
    Q5_0, Q6_K, ...) is kept in int8, not rounded again to 4 bits (SmolLM2-135M as llama.cpp's Q4_K_M, most of its
    matrices Q5_0 at that width, served int4 against the file's float32 model: top-1 82.3% -> 92.8%); under int8 a
    matrix on a 4-bit grid is kept in int4, which holds it exactly where int8's per-row grid would round it (the
    default Q4_1 model: 94.0% -> 97.0%). A float checkpoint (or projections cast to 16 bits first: on a GPU, or where
    float32 copies do not fit) gets the format asked for."""

    KEEPING = ("int8", "int4", "w4a8")  # the requests a file's bits can override

    def __init__(self, projections: list[torch.Tensor], quantization: str | None) -> None:
        self.four_bit_file = quantization in self.KEEPING and any(on_four_bit_grid(w) for w in projections)
        self.kept: dict[str, int] = {}  # format -> matrices stored in it where the file's values overrode the request

    def quantize(self, weight: torch.Tensor, quantization: str | None) -> torch.Tensor | QuantizedWeight:
        chosen = quantization
        if self.four_bit_file and quantization == "int8" and on_four_bit_grid(weight):
            chosen = "int4"
        elif self.four_bit_file and quantization in ("int4", "w4a8") and _int8_closer(weight):
            chosen = "int8"
        if chosen != quantization:
            self.kept[chosen] = self.kept.get(chosen, 0) + 1
        return quantize(weight, chosen)

    @property
    def summary(self) -> str:
        """'' or, for the start-up line, which matrices kept their file's precision."""
        kept = ", ".join(f"{n} {name}" for name, n in sorted(self.kept.items()))
        return f"kept as the file holds them: {kept}" if kept else ""


def _int8_closer(weight: torch.Tensor, rows: int = 64) -> bool:
    """Whether int8 reproduces `weight` [N, K] more closely than int4 (squared error over `rows` evenly spread rows)."""
    if weight.dim() != 2 or 0 in weight.shape:
        return False
    sample = spread_rows(weight, rows).float()
    def error(kind: type[Int8Weight] | type[Int4Weight]) -> float:
        return (kind.quantize(sample).dequantize(torch.float32) - sample).pow(2).sum().item()
    return error(Int8Weight) < error(Int4Weight)
