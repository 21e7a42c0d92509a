"""Dense bf16 weights copied into 16-row panels for bf16_panel_linear.cpp: made where the kernel plan chose that
kernel, and then the weight's only copy where it chose it for every row count.

Why: a bf16 weight used to be held twice on a CPU — the row layout, which the native streaming kernels read fastest
at one row, and oneDNN's packed copy (onednn_packs.py), which won from a few rows to prefill's thousand. The panel
kernel is as fast as either at every row count (AMD EPYC Zen 4, 2 threads: docs/kernels.md), so where the plan gives
a weight to it in all four buckets the model frees the row layout (`LlamaModel._drop_unread_layouts`, the weight
replaced by `ValuesDropped`; a tied embedding table gathers its rows from the panels, `rows`): the `1b` preset's
bf16 matrices take their 2.2 GB once, not 4.4. Offered, as oneDNN's
packed copies are, only where every dense weight's copy fits beside it (`fits`), for bf16 x on AVX512-BF16 CPUs.

Legend (bf16_panel_linear.cpp's): N rows, K columns, K2 = ceil(K / 8) * 4 column pairs, P = ceil(N / 16) panels.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch

from services.kernels.weight_copies import WeightCopies

PANEL = 16


class Bf16PanelCopy(NamedTuple):
    panels: torch.Tensor  # [P, K2, 16] int32: lane r of entry (p, j) the pair (W[16p + r, 2j], W[16p + r, 2j + 1])


def panel_copy(weight: torch.Tensor) -> Bf16PanelCopy:
    """`weight` [N, K] bf16 in the panel layout (zeros past N and K)."""
    n, k = weight.shape
    panels, pairs = -(-n // PANEL), -(-k // 8) * 4
    padded = torch.zeros(panels * PANEL, 2 * pairs, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return Bf16PanelCopy(padded.view(panels, PANEL, pairs, 2).transpose(1, 2).contiguous()
                         .view(torch.int32).view(panels, pairs, PANEL))


class ValuesDropped(torch.Tensor):
    """A dense weight's stand-in once its copies serve every product (`LlamaModel._drop_unread_layouts`): its shape,
    dtype and byte count (the plan's key, the roofline's bytes), no storage, and every operation on it raises instead
    of computing with nothing (a meta tensor would not: `F.linear` of a CPU x and a meta weight returns a CPU tensor)."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor) -> ValuesDropped:
        return torch.Tensor._make_wrapper_subclass(cls, weight.shape, dtype=weight.dtype, device=weight.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} read a weight whose values were dropped: only its copies in kernels' layouts "
                           "remain (services/kernels/bf16_panels.py)")


def without_values(weight: torch.Tensor) -> ValuesDropped:
    return ValuesDropped(weight)


def _dense_key(weight: object) -> torch.Tensor | None:
    return weight if isinstance(weight, torch.Tensor) else None


class Bf16Panels(WeightCopies[Bf16PanelCopy]):
    """Per dense bf16 weight (by identity): its panel copy, dropped with the weight or by `drop`."""

    def __init__(self) -> None:
        super().__init__(panel_copy, _dense_key)

    def linear(self, native: ModuleType, streams: int, non_temporal: bool
               ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """The LinearFn of bf16_panel_linear; for one x row each thread reads its panels as `streams` parts,
        prefetched past the caches or not."""
        def bf16_panels(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return native.bf16_panel_linear(x, self.copy(weight).panels, weight.shape[0], bias, streams, non_temporal)
        return bf16_panels

    def rows(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of `weight` [N, K], gathered from its panel copy: [T, K] bf16 (a tied embedding table whose
        values were dropped, `LlamaModel._embedding_rows`)."""
        panels = self.copy(weight).panels  # [P, K2, 16]
        pairs = panels[ids // PANEL, :, ids % PANEL]  # [T, K2] int32: each the pair (W[n, 2j], W[n, 2j + 1])
        return pairs.view(torch.bfloat16)[:, : weight.shape[1]]


BF16_PANELS = Bf16Panels()
