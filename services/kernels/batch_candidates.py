"""The native products made for batches of bf16 rows (2-64: decode batches; prefill's many rows are oneDNN's), each
reading W once a call whatever the rows: the bf16 pair panels (pair_tiled_linear.cpp, AVX512-BF16 CPUs) and the tile
unit's (amx_linear.cpp, CPUs with AMX). Offered by `linear_candidates.candidates` for bf16 x."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from services.int4_weight import Int4Weight
from services.quantized_weight import Int8Weight

Product = Callable[[torch.Tensor, "torch.Tensor | Int8Weight | Int4Weight", "torch.Tensor | None"], torch.Tensor]


def _weight_args(weight: torch.Tensor | Int8Weight | Int4Weight) -> tuple:
    """(w, scale, low) as both kernels take them: bf16 (w), int8 (values, row scales), int4 (packed, scale, low)."""
    if isinstance(weight, Int4Weight):
        return weight.packed, weight.scale, weight.low
    if isinstance(weight, Int8Weight):
        return weight.qweight, weight.scale, None
    return weight, None, None


def batch_candidates(weight_format: str, in_features: int, native: ModuleType) -> dict[str, Product]:
    """{name: product} of these kernels that this build has for a weight of `weight_format` ("bfloat16", "int8",
    "int4"; none for the others) and `in_features` columns."""
    if weight_format not in ("bfloat16", "int8", "int4"):
        return {}
    found: dict[str, Product] = {}
    # W converted once a call into bf16 pair panels, register tiles of vdpbf16ps: at 1,024 rows it lost to
    # dequantize + oneDNN (int8 16384 x 2048, Zen 4: 276 vs 207 ms), which the 65+ bucket's 128-row probe would not
    # see (27 vs 39 ms there)
    if hasattr(native, "pair_tiled_linear"):
        pairs = native.pair_tiled_linear

        def pair_panels(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
            w, scale, low = _weight_args(weight)
            return pairs(x, None, scale, w, low, bias) if low is not None else pairs(x, w, scale, None, None, bias)
        found["native.pairs"] = pair_panels
    # W's rows loaded as tiles where they lie: at 1,024 rows its re-reads of x lost 2x to oneDNN (16384 x 2048: 178
    # vs 91 ms) where the 65+ bucket's 128-row probe saw them close (15 vs 10 ms)
    if hasattr(native, "amx_linear") and native.amx_ready() and in_features % 32 == 0:
        tiles = native.amx_linear

        def amx(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
            return tiles(x, *_weight_args(weight), bias)
        found["native.amx"] = amx
    return found
