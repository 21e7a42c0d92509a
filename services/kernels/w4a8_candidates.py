"""w4a8's products: int4 weights (in panels: services/w4a8_weight.py) times activations rounded to int8 per
32-column group.

Each row of x is cut into groups of 32 columns (W's own int4 groups); a group's largest magnitude maps to 127
and every value is rounded to the nearest step (halves to even): x_q = round(x / s) * s, s = max |x| / 127 —
llama.cpp's Q8_0 activations, which its Q4 weights multiply. Every product rounds x so, whatever its row count.

- `native.w4a8` (w4a8_linear.cpp on CPUs with AVX512-VNNI: vpdpbusd, 64 pairs an instruction, twice vdpbf16ps's;
  w4a8_avx2_linear.cpp on AVX2 ones: vpmaddubsw): the int8 values times W's 4-bit levels in int32, scaled per group
  in float32, every output one float32 chain in the same order whatever the rows (and in both builds):
  bit-identical for one row (a decode step) and a thousand (a prefill).
  It is w4a8's only product there: another kernel's sums, a rounding apart, would round some x to the other
  int8 neighbour a layer later (the `tiny` model with the definition below for 2-8 rows: a prefill's logits and
  its 7-token chunks' 0.033 apart). The attention's sums still differ between a prefill and a decode step and
  can do the same, rarely (the `tiny` model's later logits: 3.5e-4 on a CI host, 0.055 with the AVX2 build).
- `x8.dequant.linear` elsewhere (CPUs without AVX2, no compiler, GPUs): the definition in torch's operators, x_q
  times W dequantized.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from services.int4_weight import GROUP
from services.w4a8_weight import W4A8Weight

Product = Callable[[torch.Tensor, W4A8Weight, "torch.Tensor | None"], torch.Tensor]


def fake_quantize_groups(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each 32-column group of each row rounded to int8 (see the module's docstring), x's dtype:
    torch's operators, the definition the native `fake_quantize_groups` and `w4a8_linear` are tested against."""
    rows, k = x.shape
    groups = F.pad(x.float(), (0, -k % GROUP)).view(rows, -1, GROUP)  # zeros past K: no group's maximum grows
    amax = groups.abs().amax(dim=2, keepdim=True)
    step = amax / 127
    levels = torch.round(groups / torch.where(amax > 0, step, torch.ones_like(step)))  # an all-zero group stays 0
    return (levels * step).view(rows, -1)[:, :k].to(x.dtype)


def w4a8_candidates(native: ModuleType | None, on_cpu: bool) -> dict[str, Product]:
    if on_cpu and native is not None and hasattr(native, "w4a8_linear"):
        kernel = native.w4a8_linear

        def int8_dots(x: torch.Tensor, weight: W4A8Weight, bias: torch.Tensor | None) -> torch.Tensor:
            return kernel(x, weight.packed, weight.scale, weight.low, weight.out_features, bias)
        return {"native.w4a8": int8_dots}
    return {"x8.dequant.linear": _definition}


def _definition(x: torch.Tensor, weight: W4A8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    # x_q exact in float32 (an int8 times its step), W dequantized: one float32 product, rounded once
    y = F.linear(fake_quantize_groups(x.float()), weight.dequantize(torch.float32), None if bias is None else bias.float())
    return y.to(x.dtype)
