"""Weight-only int8 weights copied into 16-row panels, made where the kernel plan chose a kernel that reads them; where
every chosen kernel does, the weight's rows are dropped (`Int8Weight.without_rows`) and the panels are its only copy.

Why a copy: at one row of bf16 x the panel kernel (int8_panel_linear.cpp) streams an int8 weight 1.16-1.25x faster
than its row layout's kernels (AMD EPYC Zen 4, 2 threads, distinct `1b` weights cycled from memory, docs/kernels.md),
and gives int8_digits_linear's product bit for bit. Several rows read the same copy through that kernel's passes of 4
rows, or through pair_tiled_linear.cpp's bf16 pair tiles (`native.panels.pairs`: its product from the rows, bit for
bit), and prefill through `native.panels.tiles` (panel_tiled_linear.cpp: the pair tiles' product bit for bit, at the
bf16 panels' speed) or `dequant.panels` (W's integers from the copy, then dequant.linear's product: bit for bit): so
the rows are needed only where a row kernel was timed faster. The copy is offered only where every weight's copy
fits (`onednn_packs.fits`), preferred in the decode buckets (`weight_layouts.preference`), kept only for the weights
whose plan chose it, and beside rows that stay only for the one-row bucket (`weight_layouts.int8_panels_beside_rows`).

Legend (int8_panel_linear.cpp's): N rows, K columns, Kp = K rounded up to 64, K4 = Kp / 4, P = ceil(N / 16) panels.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.kernels.dequant_buffer import DEQUANT_BUFFER
from services.kernels.weight_copies import WeightCopies
from services.quantized_weight import Int8Weight

PANEL = 16
# linear_candidates.LinearFn for this format
Int8LinearFn = Callable[[torch.Tensor, Int8Weight, torch.Tensor | None], torch.Tensor]


class Int8PanelCopy(NamedTuple):
    panels: torch.Tensor  # [P, K4, 16] int32: lane r of entry (p, j) W[16p + r, 4j .. 4j + 3] + 128 as 4 bytes
    scale: torch.Tensor  # [P * 16] float32 (zeros past N)


def panel_copy(weight: Int8Weight) -> Int8PanelCopy:
    """`weight`'s values in the panel layout (rows past N and columns past K hold the value 0)."""
    n, k = weight.shape
    panels, kp = -(-n // PANEL), -(-k // 64) * 64
    biased = torch.full((panels * PANEL, kp), 128, dtype=torch.uint8)
    biased[:n, :k] = (weight.qweight.to(torch.int16) + 128).to(torch.uint8)
    scale = torch.zeros(panels * PANEL, dtype=torch.float32)
    scale[:n] = weight.scale
    quads = biased.view(panels, PANEL, kp // 4, 4).transpose(1, 2).contiguous()  # [P, K4, 16 rows, 4 columns]
    return Int8PanelCopy(quads.view(torch.int32).view(panels, kp // 4, PANEL), scale)


def _int8_key(weight: object) -> torch.Tensor | None:
    # weight-only int8 (w8a8's products round x to int8 themselves)
    return weight.qweight if type(weight) is Int8Weight and not weight.dynamic_activations else None


class Int8Panels(WeightCopies[Int8PanelCopy]):
    """Per weight-only int8 weight (by the identity of its values): its panel copy, dropped with the weight or by
    `drop`."""

    def __init__(self) -> None:
        super().__init__(panel_copy, _int8_key)

    def linear(self, native: ModuleType, streams: int, non_temporal: bool) -> Int8LinearFn:
        """The LinearFn of int8_panel_linear; for one x row each thread reads its panels as `streams` parts,
        prefetched past the caches or not."""
        def int8_panels(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
            copy = self.copy(weight)
            return native.int8_panel_linear(x, copy.panels, copy.scale, weight.shape[0], bias, streams, non_temporal)
        return int8_panels

    def bf16_linear(self, native: ModuleType, streams: int, non_temporal: bool) -> Int8LinearFn:
        """Several rows by bf16 pairs from this copy (int8_panel_bf16_linear), up to 4 rows read as `streams` parts."""
        def int8_panel_bf16(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
            copy = self.copy(weight)
            return native.int8_panel_bf16_linear(x, copy.panels, copy.scale, weight.shape[0], bias, streams,
                                                 non_temporal)
        return int8_panel_bf16

    def pairs_linear(self, native: ModuleType) -> Int8LinearFn:
        """Batches: pair_tiled_linear's product (`native.pairs`) bit for bit, W converted into its bf16 pair panels
        from this copy (int8_panel_pairs_linear) instead of the rows."""
        def int8_panel_pairs(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
            copy = self.copy(weight)
            return native.int8_panel_pairs_linear(x, copy.panels, copy.scale, weight.shape[0], bias)
        return int8_panel_pairs

    def tiled_linear(self, native: ModuleType) -> Int8LinearFn:
        """Many rows (prefill, large batches): `native.pairs`' product bit for bit, two panels converted into bf16 pairs
        a pass and the bf16 panels' register tiles over every row (panel_tiled_linear.cpp)."""
        def int8_panel_tiles(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
            copy = self.copy(weight)
            return native.int8_panel_tiled_linear(x, copy.panels, copy.scale, weight.shape[0], bias)
        return int8_panel_tiles

    def dequant_linear(self, native: ModuleType) -> Int8LinearFn:
        """Many rows (prefill): W's integers from this copy (int8_panel_dequantize), then `dequant.linear`'s dense bf16
        product and scaling — its output bit for bit, without the rows."""
        def dequant_panels(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
            out = DEQUANT_BUFFER.scratch(weight.shape, torch.bfloat16, x.device)
            dense = native.int8_panel_dequantize(self.copy(weight).panels, weight.shape[0], out)
            y = F.linear(x.to(torch.bfloat16), dense, None).mul_(weight.scale.to(torch.bfloat16))
            return (y if bias is None else y.add_(bias)).to(x.dtype)
        return dequant_panels


INT8_PANELS = Int8Panels()
