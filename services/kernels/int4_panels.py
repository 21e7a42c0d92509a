"""Int4 weights copied into 16-row panels for int4_panel_linear.cpp, made once and kept beside the weight where the
kernel plan chose that kernel.

Why a copy: the panel kernel reads an int4 weight's bytes 1.1-1.6x faster at one row of bf16 x than the kernels of
its row layout (AMD EPYC Zen 4, 2 threads: docs/kernels.md). The copy costs the weight's bytes again (0.625 a
weight), offered only where every int4 weight's copy fits (`fits`) and kept only for the weights whose plan chose it;
where every chosen kernel reads it (the panels' passes for batches, panel_tiled_linear.cpp's tiles or
int4_panel_dequantize.cpp for prefill) the row layout goes (`Int4Weight.without_rows`).

Legend (int4_panel_linear.cpp's): N rows, Kp columns padded to whole 64-column blocks, P = ceil(N / 16) panels,
O = Kp / 8 column octets, G = 32.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.int4_weight import GROUP, Int4Weight
from services.kernels.dequant_buffer import DEQUANT_BUFFER
from services.kernels.weight_copies import WeightCopies

PANEL = 16
# linear_candidates.LinearFn for this format
Int4LinearFn = Callable[[torch.Tensor, Int4Weight, torch.Tensor | None], torch.Tensor]


def _octet_order() -> tuple[torch.Tensor, torch.Tensor]:
    """For byte 16L + i of an octet: its W row in the panel and the octet column of its low nibble (the high
    nibble's is 4 more). unpacklo/hi_epi8 take bytes 0..7 / 8..15 of each 128-bit lane L as the words of 32-bit
    lanes 4L .. 4L + 3, so lane r is row r, and its two words two adjacent columns."""
    lane, i = torch.arange(64) // 16, torch.arange(64) % 16
    return 4 * lane + (i % 8) // 2, 2 * (i >= 8).long() + i % 2


ROW_OF_BYTE, COLUMN_OF_BYTE = _octet_order()


class PanelCopy(NamedTuple):
    packed: torch.Tensor  # [P, O, 64] uint8
    scale: torch.Tensor  # [P, Kp / G, 16] float16
    low: torch.Tensor  # [P, Kp / G, 16] float16

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self)


def panel_copy(weight: Int4Weight) -> PanelCopy:
    """`weight`'s values in the panel layout (the missing rows of the last panel zero)."""
    levels = weight.levels()  # [N, Kp]
    n, kp = levels.shape
    panels = -(-n // PANEL)
    q = torch.zeros(panels * PANEL, kp, dtype=torch.uint8)
    q[:n] = levels
    octets = q.view(panels, PANEL, kp // 8, 8).transpose(1, 2)  # [P, O, 16 rows, 8 columns]
    low_nibbles = octets[:, :, ROW_OF_BYTE, COLUMN_OF_BYTE]
    high_nibbles = octets[:, :, ROW_OF_BYTE, COLUMN_OF_BYTE + 4]
    packed = (low_nibbles | (high_nibbles << 4)).contiguous()  # [P, O, 64]

    def by_panel(values: torch.Tensor) -> torch.Tensor:  # [N, Kp / G] -> [P, Kp / G, 16]
        padded = torch.zeros(panels * PANEL, kp // GROUP, dtype=values.dtype)
        padded[:n] = values
        return padded.view(panels, PANEL, kp // GROUP).transpose(1, 2).contiguous()

    return PanelCopy(packed, by_panel(weight.scale), by_panel(weight.low))


def _int4_key(weight: object) -> torch.Tensor | None:
    return weight.packed if type(weight) is Int4Weight else None


class Int4Panels(WeightCopies[PanelCopy]):
    """Per int4 weight (by the identity of its bytes): its panel copy, dropped with the weight or by `drop`."""

    def __init__(self) -> None:
        super().__init__(panel_copy, _int4_key)

    def linear(self, native: ModuleType, streams: int, non_temporal: bool) -> Int4LinearFn:
        """The LinearFn of int4_panel_linear reading W as `streams` parts, prefetched past the caches or not."""
        def int4_panels(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
            return native.int4_panel_linear(x, *self.copy(weight), weight.shape[0], bias, streams, non_temporal)
        return int4_panels

    def tiled_linear(self, native: ModuleType) -> Int4LinearFn:
        """Many rows (prefill, large batches): `native.pairs`' product bit for bit, two panels dequantized into bf16
        pairs a pass and the bf16 panels' register tiles over every row (panel_tiled_linear.cpp)."""
        def int4_panel_tiles(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
            return native.int4_panel_tiled_linear(x, *self.copy(weight), weight.shape[0], bias)
        return int4_panel_tiles

    def dequant_linear(self, native: ModuleType) -> Int4LinearFn:
        """Many rows (prefill): W dequantized whole from the panel copy (int4_panel_dequantize.cpp), then one dense bf16
        product. Bit for bit `dequant.linear` (the same W from the row layout, the same product), so a weight whose
        decode reads the panels can drop its row layout (`Int4Weight.without_rows`)."""
        def dequant_panels(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
            out = DEQUANT_BUFFER.scratch((weight.shape[0], weight.in_features), torch.bfloat16, x.device)
            copy = self.copy(weight)
            dense = native.int4_panel_dequantize(copy.packed, copy.scale, copy.low, weight.shape[0], out)
            return F.linear(x.to(torch.bfloat16), dense, None if bias is None else bias.to(torch.bfloat16)).to(x.dtype)
        return dequant_panels


INT4_PANELS = Int4Panels()
