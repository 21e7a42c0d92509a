"""w8a8's products on a CPU: int8 weights (per output channel) times activations rounded to int8 per row.

Each row of x is rounded to int8 with its own scale (its largest magnitude -> 127, halves to even), multiplied by
int8 W exactly in int32, then both scales applied. Every product rounds x so, whatever its row count: a request's
answer must not depend on how many rows share its step (a prefix-cache hit, a batch) — a weight-only kernel for
some buckets would compute a different model there. All three candidates compute that definition bit for bit, so the
plan may time them at every row count:
- `int8.dynamic`: torch's operators around `torch._int_mm` (oneDNN's VNNI or AMX-int8 kernels) — the definition;
- `int8.dynamic.native`: the same product, its rounding and scaling one native pass each (w8a8_matmul_parts.cpp):
  where `_int_mm` is fast (AMX) the operators around it were most of the time;
- `native.w8a8` (and, for 9+ rows on AVX512-VNNI CPUs, `native.w8a8.panels`): the whole product native
  (w8a8_linear.cpp: vpdpbusd, or vpmaddubsw on AVX2 CPUs);
- `native.w8a8.row*` (one row, AVX512-VNNI CPUs): the same with W streamed row by row, as 1 or 4 parts, prefetched
  into the caches or past them (stream_variants.X16_VARIANTS' names);
- `native.w8a8.amx` (2-64 rows, K a multiple of 64, CPUs with AMX): the same with the products on the tile unit
  (amx_w8a8_linear.cpp: tdpbssd).
Off the CPU w8a8 runs int8's weight-only products (linear_candidates.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from services.kernels.dequant_buffer import DEQUANT_BUFFER
from services.kernels.stream_variants import X16_VARIANTS, parts_name
from services.quantized_weight import Int8Weight

W8A8Fn = Callable[[torch.Tensor, Int8Weight, "torch.Tensor | None"], torch.Tensor]


def _int8_dynamic_mm(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    # w8a8: each row of x rounded to int8 with its own scale (largest magnitude -> 127), then one
    # int8 x int8 -> int32 product (exact; oneDNN's VNNI/AMX kernels), then both scales applied
    x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-30).div_(127.0)  # [M, 1]
    xq = (x.float() / x_scale).round_().to(torch.int8)  # [M, K] (x itself is left as it was)
    shape = (x.shape[0], weight.qweight.shape[0])
    products = torch._int_mm(xq, weight.qweight.t(), out=DEQUANT_BUFFER.scratch(shape, torch.int32, x.device))
    y = torch.mul(products, x_scale, out=DEQUANT_BUFFER.scratch(shape, torch.float32, x.device)).mul_(weight.scale)
    y = y.to(x.dtype, copy=True)  # [M, N], out of the buffer (a float32 y would otherwise be it)
    return y if bias is None else y.add_(bias)


def _int8_dynamic_native(native: ModuleType) -> W8A8Fn:
    # _int8_dynamic_mm's definition with its rounding and scaling each one native pass (w8a8_matmul_parts.cpp) around
    # the same torch._int_mm: where that product is fast (AMX), the torch operators around it were most of the time
    def w8a8(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        xq, x_scale = native.w8a8_round_rows(x)
        shape = (x.shape[0], weight.qweight.shape[0])
        products = torch._int_mm(xq, weight.qweight.t(), out=DEQUANT_BUFFER.scratch(shape, torch.int32, x.device))
        return native.w8a8_scale_products(products, x_scale, weight.scale, bias, x)
    return w8a8


def _native_w8a8(kernel: Callable, *options: int) -> W8A8Fn:
    # options: the kernel's own trailing arguments (w8a8_row_linear's streams and non_temporal)
    def w8a8(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(x, weight.qweight, weight.scale, None if bias is None else bias.to(x.dtype), *options)
    return w8a8


def w8a8_candidates(native: ModuleType | None, max_rows: int, in_features: int) -> dict[str, W8A8Fn]:
    """The products of a w8a8 weight of `in_features` columns for batches of up to `max_rows` rows on a CPU, the
    definition first."""
    found: dict[str, W8A8Fn] = {"int8.dynamic": _int8_dynamic_mm}
    if native is not None and hasattr(native, "w8a8_round_rows"):
        found["int8.dynamic.native"] = _int8_dynamic_native(native)
    if native is not None and hasattr(native, "w8a8_linear"):
        found["native.w8a8"] = _native_w8a8(native.w8a8_linear)
    if native is not None and max_rows > 8 and hasattr(native, "w8a8_panel_linear"):
        # the same product by other register tiles (w8a8_x_panels.h): 1.1-1.4x at 16-256 rows with K 2,048,
        # 0.75-0.85x with K 8,192 (AMD EPYC Zen 4), so both are timed
        found["native.w8a8.panels"] = _native_w8a8(native.w8a8_panel_linear)
    if native is not None and max_rows == 1 and hasattr(native, "w8a8_row_linear"):
        # one row: W streamed row by row instead of 4 rows a tile (w8a8_linear.cpp's row_product)
        for streams, nt in X16_VARIANTS:
            found[parts_name("native.w8a8.row", streams, nt)] = _native_w8a8(native.w8a8_row_linear, streams, nt)
    if (native is not None and 1 < max_rows <= 64 and in_features % 64 == 0 and hasattr(native, "amx_w8a8_linear")
            and native.amx_ready()):
        # the products on the tile unit (amx_w8a8_linear.cpp); past 64 rows oneDNN's `_int_mm` (int8.dynamic*)
        found["native.w8a8.amx"] = _native_w8a8(native.amx_w8a8_linear)
    return found
