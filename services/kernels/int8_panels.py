"""Weight-only int8 weights copied into 16-row panels for int8_panel_linear.cpp, made where the kernel plan chose that
kernel and kept beside the weight's rows.

Why a copy: at one row of bf16 x the panel kernel streams an int8 weight 1.16-1.25x faster than its row layout's
kernels (AMD EPYC Zen 4, 2 threads, distinct `1b` weights cycled from memory, docs/kernels.md), and gives
int8_digits_linear's product bit for bit; at 4-32 rows it runs 0.9-1.2x the row layout's best, so the rows stay.
The copy (the weight's bytes again) is offered only where every weight's copy fits (`onednn_packs.fits`), preferred at
one row (`weight_layouts.preference`), and kept only for the weights whose plan chose it.

Legend (int8_panel_linear.cpp's): N rows, K columns, Kp = K rounded up to 64, K4 = Kp / 4, P = ceil(N / 16) panels.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch

from services.kernels.weight_copies import WeightCopies
from services.quantized_weight import Int8Weight

PANEL = 16


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

    def linear(self, native: ModuleType, streams: int, non_temporal: bool
               ) -> Callable[[torch.Tensor, Int8Weight, torch.Tensor | None], torch.Tensor]:
        """The LinearFn of int8_panel_linear; for one x row each thread reads its panels as `streams` parts,
        prefetched past the caches or not."""
        def int8_panels(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
            copy = self.copy(weight)
            return native.int8_panel_linear(x, copy.panels, copy.scale, weight.shape[0], bias, streams, non_temporal)
        return int8_panels


INT8_PANELS = Int8Panels()
