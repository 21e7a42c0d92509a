"""Which layouts of a weight the kernel plan's choices read, and the copies in kernels' own layouts kept for them.

A weight can be held in up to three layouts on a CPU: its own (the rows the model loaded), oneDNN's packed copy
(onednn_packs.py) and a panel copy (int4_panels.py, int8_panels.py, bf16_panels.py). Each costs the weight's bytes
again, so:
- a panel copy is preferred within PREFER_MARGIN of the fastest candidate (PREFILL_PREFER_MARGIN in prefill's
  bucket), since a weight whose every bucket reads its panels frees its own layout (`LlamaModel._drop_unread_layouts`)
  and between candidates this close the timing's noise, not the kernels, would decide its memory (`preference`);
- a dense weight never keeps all three: where its buckets chose its rows, oneDNN's copy and the panels, the panels'
  buckets are chosen again without them (`reads_three_layouts`); an int8 weight keeps its panels beside its rows only
  for its one-row bucket and prefill (`int8_panels_beside_rows`), and no quantized weight keeps the copy for prefill
  alone (`panels_for_prefill_alone`);
- copies are made at the plan's end for the weights that read them and dropped for the others (`keep_chosen_copies`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import NamedTuple

import torch

from services.int4_weight import Int4Weight
from services.kernels.bf16_panels import BF16_PANELS
from services.kernels.int4_panels import INT4_PANELS
from services.kernels.int8_panels import INT8_PANELS
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.kernels.weight_copies import WeightCopies
from services.quantized_weight import Int8Weight

PREFER_MARGIN = 1.03
# prefill's bucket: a compute-bound product, where the panels ran 1.00-1.03x oneDNN's packed copy at 1,024 rows (Zen 4)
# but a 3-round timing at 128 rows gave one `1b` shape (2048 x 8192) to oneDNN, whose copy then cost 512 MiB beside
# the panels: the copy is kept only for a product more than 10% faster
PREFILL_PREFER_MARGIN = 1.10
Names = tuple[str, ...]  # a candidate name per row bucket (kernel_plan.BUCKETS)


class Preference(NamedTuple):
    """Candidates `names` picks win when within `margin` of the fastest (kernel_plan._fastest)."""

    names: Callable[[str], bool]
    margin: float


def reads_panels(name: str) -> bool:
    return name.startswith("native.panels") or name == "dequant.panels"


def preference(key: tuple, rows: int) -> Preference | None:
    """The preference of a weight of `key` (kernel_plan.weight_key) timed at `rows`: its panels in the decode buckets
    of int4 and weight-only int8 (their prefill reads the panels through `from_panels_alone`), every bucket of a bf16
    weight (the panel kernel serves all). At one row int8's panels are never slower and when the host's memory runs
    fast 1.15-1.28x faster, which a plan timed in one of its slow spells (all kernels alike at ~28 GB/s, AMD EPYC
    Zen 4) would not see (docs/kernels.md)."""
    if key[-1] == "bfloat16":
        return Preference(reads_panels, PREFER_MARGIN if rows <= 64 else PREFILL_PREFER_MARGIN)
    return Preference(reads_panels, PREFER_MARGIN) if key[-1] in ("int4", "int8") and rows <= 64 else None


def reads_three_layouts(names: Names) -> bool:
    """Whether a dense weight's choices read its rows, oneDNN's packed copy and its panels: three copies."""
    panels = any(reads_panels(n) for n in names)
    return panels and "onednn.packed" in names and not all(reads_panels(n) or n == "onednn.packed" for n in names)


def int8_panels_beside_rows(key: tuple, names: Names) -> bool:
    """Whether a weight-only int8 weight's choices read its rows in a decode bucket, so the rows stay, and its panel
    copy in a batch bucket (2-64 rows). Beside the rows the copy is worth its bytes only for the one-row bucket, where
    it streams faster; in batches the panel kernels run within a few percent of the rows' (`native.panels.pairs` is
    `native.pairs`' product), preferred only so that the rows could go: those buckets are chosen again without them
    (the `1b` int8 batch-32 step on the copy's pair tiles, rows kept: 283 against 269 ms, AMD EPYC Zen 4). Prefill
    keeps its choice: with the copy held for one row, `native.panels.tiles` costs nothing more."""
    decode = names[:3]
    return (key[-1] == "int8" and any(reads_panels(n) for n in decode[1:])
            and not all(reads_panels(n) for n in decode))


def panels_for_prefill_alone(key: tuple, names: Names) -> bool:
    """Whether an int4 or int8 weight's prefill bucket alone reads its panel copy (`native.panels.tiles`): the copy
    would cost the weight's bytes again for a product 3-9% faster than the rows' (1,024 rows, AMD EPYC Zen 4), so
    that bucket is chosen again without it."""
    return key[-1] in ("int4", "int8") and reads_panels(names[-1]) and not any(reads_panels(n) for n in names[:-1])


def from_panels_alone(key: tuple, names: Names, native: ModuleType | None) -> Names:
    """An int4 or weight-only int8 weight whose decode buckets all read its panel copy takes its prefill's dense W from
    there too where the row layout's was chosen: bit for bit the same W and product (int4_panels.py, int8_panels.py),
    and the row layout, read by nothing else, can go (`KernelPlan.reads_rows`)."""
    dequantize = {"int4": "int4_panel_dequantize", "int8": "int8_panel_dequantize"}.get(key[-1])
    if (dequantize and names[-1] == "dequant.linear" and all(reads_panels(n) for n in names[:-1])
            and hasattr(native, dequantize)):
        return (*names[:-1], "dequant.panels")
    return names


def _panel_copies(weight: torch.Tensor | Int4Weight | Int8Weight) -> WeightCopies:
    if isinstance(weight, torch.Tensor):
        return BF16_PANELS
    return INT4_PANELS if isinstance(weight, Int4Weight) else INT8_PANELS


def keep_chosen_copies(dense: Iterable[torch.Tensor], quantized: Iterable[Int4Weight | Int8Weight],
                       names_of: Callable[[torch.Tensor | Int4Weight | Int8Weight], Names]) -> int:
    """Make now (not in the first request) the copy of every weight whose plan chose a kernel reading its own copy
    (oneDNN's packed dense weights; dense, int4 and weight-only int8 panels), drop the copies timing made of the
    others; returns the bytes kept."""
    dense, kept = list(dense), 0
    for weight in dense:
        if "onednn.packed" in names_of(weight):
            kept += ONEDNN_PACKS.packed(weight).numel() * weight.element_size()
        else:
            ONEDNN_PACKS.drop(weight)
    chosen: dict[WeightCopies, list] = {BF16_PANELS: [], INT4_PANELS: [], INT8_PANELS: []}
    for weight in (*dense, *quantized):
        if any(reads_panels(name) for name in names_of(weight)):
            chosen[_panel_copies(weight)].append(weight)
        else:
            _panel_copies(weight).drop(weight)
    return kept + sum(copies.keep(weights) for copies, weights in chosen.items())
