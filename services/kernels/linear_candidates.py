"""Every way this host can compute y = x @ W^T (+ bias), by name, for each weight format.

Each candidate takes (x [M, K], weight, bias [N] | None) and returns [M, N] in x's dtype. Which
one runs for a given weight shape and row count is measured on the host (`kernel_plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from services.quantized_weight import Int8Weight

LinearFn = Callable[[torch.Tensor, "torch.Tensor | Int8Weight", "torch.Tensor | None"], torch.Tensor]


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _torch_mv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # one row only: matrix-vector (addmv), which streams faster than F.linear on some CPUs (AMX Xeons)
    y = torch.mv(weight, x[0]).unsqueeze(0)
    return y if bias is None else y + bias


def _int8_dequant_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    # int8 values are exact in bf16/fp16: one dense product, then each output column scaled
    y = F.linear(x, weight.qweight.to(x.dtype)) * weight.scale.to(x.dtype)
    return y if bias is None else y + bias


def _int8_pack_mm(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch._weight_int8pack_mm(x, weight.qweight, weight.scale.to(x.dtype))
    return y if bias is None else y + bias


def _native(module: ModuleType, rows: int) -> LinearFn:
    # rows: W rows in flight per thread (1: one sequential stream; 4: four streams, prefetched)
    def skinny(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, Int8Weight):
            return module.skinny_linear(x, weight.qweight, weight.scale, bias, rows)
        return module.skinny_linear(x, weight, None, bias, rows)
    return skinny


def candidates(quantized: bool, on_cpu: bool, in_features: int, max_rows: int, native: ModuleType | None
               ) -> dict[str, LinearFn]:
    """The kernels that can run a weight (int8 when `quantized`, else dense) of `in_features`
    columns for batches of up to `max_rows` rows, on the CPU or not."""
    if quantized:
        found: dict[str, LinearFn] = {"dequant.linear": _int8_dequant_linear}
        # torch's weight-only kernel is made for few rows; beyond 64 (prefill) the product is
        # compute-bound and one dequantized dense product wins. It crashes (SIGSEGV, torch 2.13) on
        # widths that are not a multiple of 16.
        if on_cpu and in_features % 32 == 0 and max_rows <= 64:
            found["torch.int8pack"] = _int8_pack_mm
    else:
        found = {"torch.linear": _torch_linear}
        if on_cpu and max_rows == 1:
            found["torch.mv"] = _torch_mv
    if on_cpu and native is not None and max_rows <= 64:  # a streaming kernel: only for few rows
        found["native"] = _native(native, 1)
        found["native.4rows"] = _native(native, 4)
    return found
