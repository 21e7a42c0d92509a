"""Every way this host can compute y = x @ W^T (+ bias), by name, for each weight format.

Each candidate takes (x [M, K], weight, bias [N] | None) and returns [M, N] in x's dtype. Which
one runs for a given weight shape and row count is measured on the host (`kernel_plan`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from services.int4_weight import GROUP, Int4Weight
from services.kernels.batch_candidates import batch_candidates
from services.kernels.bf16_panels import BF16_PANELS, Bf16Panels
from services.kernels.dequant_buffer import DEQUANT_BUFFER
from services.kernels.int4_panels import INT4_PANELS, Int4Panels
from services.kernels.int8_panels import INT8_PANELS, Int8Panels
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.kernels.stream_variants import PANEL_VARIANTS, SKINNY_VARIANTS, X16_VARIANTS, parts_name
from services.kernels.w4a8_candidates import w4a8_candidates
from services.kernels.w8a8_candidates import w8a8_candidates
from services.quantized_weight import Int8Weight

LinearFn = Callable[[torch.Tensor, "torch.Tensor | Int8Weight | Int4Weight", "torch.Tensor | None"], torch.Tensor]


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _torch_mv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # one row only: matrix-vector (addmv), which streams faster than F.linear on some CPUs (AMX Xeons)
    y = torch.mv(weight, x[0]).unsqueeze(0)
    return y if bias is None else y + bias


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product on a plain weight (it blocks W inside the call; no copy is kept); the matmul ceilings
    time it too (services/hardware_peaks.py, benchmarks/ceilings.py)."""
    # torch's float32 F.linear is MKL's GEMM, which on some CPUs runs far below oneDNN's: AMD EPYC Zen 2,
    # 2 threads, 1,024 rows of a 16384 x 2048 weight, 61 against 89 GFLOP/s; 128 rows 38 against 80
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def _float32_linear(product: LinearFn = F.linear) -> LinearFn:
    # A 16-bit weight upcast into the reused buffer, then one float32 product, rounded once (as a 16-bit
    # product accumulates in float32 and rounds once): where the CPU has no 16-bit matrix instructions,
    # torch's bf16 product is a slow fallback (AMD EPYC Zen 3, AVX2, 2 threads: 21 GFLOP/s at 1,024 rows
    # against 142 for float32; the upcast of a 16384 x 2048 weight costs 5.5 ms of its 480)
    def float32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = product(x.float(), DEQUANT_BUFFER.holding(weight, torch.float32), None if bias is None else bias.float())
        return y.to(x.dtype)
    return float32_linear


def _int8_dequant_linear(compute: torch.dtype | None = None, product: LinearFn = F.linear) -> LinearFn:
    # int8 values are exact in bf16/fp16: one dense product in `compute` (None: x's dtype; float32 where
    # 16-bit products are slow, see _float32_linear), then each output column scaled
    def dequant_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = compute or x.dtype
        y = product(x.to(dtype), DEQUANT_BUFFER.holding(weight.rows(), dtype), None).mul_(weight.scale.to(dtype))
        y = y if bias is None else y.add_(bias)
        return y.to(x.dtype)
    return dequant_linear


def _int8_pack_mm(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch._weight_int8pack_mm(x, weight.rows(), weight.scale.to(x.dtype))
    return y if bias is None else y + bias


def _int4_dequant_linear(native: ModuleType | None, compute: torch.dtype | None = None,
                         product: LinearFn = F.linear) -> LinearFn:
    # many rows (prefill): the product is compute-bound, so W is dequantized once and multiplied densely,
    # in `compute` (None: x's dtype; float32 where 16-bit products are slow, see _float32_linear)
    def dequant_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = compute or x.dtype
        if native is not None and x.device.type == "cpu":
            out = DEQUANT_BUFFER.scratch((weight.shape[0], weight.in_features), dtype, x.device)
            dense = native.int4_dequantize(weight.packed, weight.scale, weight.low, out)
        else:
            dense = weight.dequantize(dtype)
        return product(x.to(dtype), dense, None if bias is None else bias.to(dtype)).to(x.dtype)
    return dequant_linear


# torch's own int4 kernel reads its own packing of the same values, made on first use and kept with
# the weight (twice the weight's memory, only for weights where it is timed or chosen).
_torch_int4_packs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight.packed) -> its packing


def _int4_pack_mm(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    key = id(weight.packed)
    if key not in _torch_int4_packs:
        n, k = weight.shape
        rows = -(-n // 16) * 16  # torch's packing takes whole 16s of rows
        q = torch.zeros(rows, k, dtype=torch.int32)
        q[:n] = weight.levels()  # k is whole blocks here: no padding
        scale, low = torch.ones(rows, k // GROUP), torch.zeros(rows, k // GROUP)
        scale[:n], low[:n] = weight.scale.float(), weight.low.float()
        # torch's int4 values are centred: w = (q - 8) * scale + zero, so zero = low + 8 * scale
        scale_zeros = torch.stack([scale, low + 8 * scale], dim=2).transpose(0, 1).contiguous()  # [K / G, N', 2]
        _torch_int4_packs[key] = (torch._convert_weight_to_int4pack_for_cpu(q, 2), scale_zeros)
        weakref.finalize(weight.packed, _torch_int4_packs.pop, key, None)  # dropped with the weight
    packed, scale_zeros = _torch_int4_packs[key]
    y = torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zeros.to(x.dtype))[:, : weight.shape[0]]
    return y if bias is None else y + bias


def _values_and_scale(weight: torch.Tensor | Int8Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The native kernels' (w, scale) arguments: int8 values and their row scales, or a dense weight and None."""
    return (weight.qweight, weight.scale) if isinstance(weight, Int8Weight) else (weight, None)


def _native(module: ModuleType, rows: int, non_temporal: bool = False, parts: bool = False) -> LinearFn:
    # rows: W rows in flight per thread (1: one sequential stream; 4: four streams, prefetched, into the caches
    # or past them: non_temporal), adjacent rows or one from each quarter of the rows a thread takes at a time (parts)
    def skinny(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        return module.skinny_linear(x, *_values_and_scale(weight), bias, rows, non_temporal, parts)
    return skinny


def _native_tiled(kernel: Callable) -> LinearFn:
    def tiled(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(x, *_values_and_scale(weight), bias)
    return tiled


def _native_int8_x16(kernel: Callable, streams: int = 1, non_temporal: bool = False) -> LinearFn:
    def int8_x16(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(x, weight.qweight, weight.scale, bias, streams, non_temporal)
    return int8_x16


def _native_int4(kernel: Callable, *options: int) -> LinearFn:
    # options: the kernel's own trailing arguments (the x16 kernel's streams and non_temporal)
    def int4(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(x, weight.packed, weight.scale, weight.low, bias, *options)
    return int4


def _panel_variants(copies: Int4Panels | Int8Panels | Bf16Panels, native: ModuleType, max_rows: int
                    ) -> dict[str, LinearFn]:
    # one row: every streaming variant (PANEL_VARIANTS); several: one stream, into the caches or past them
    return {parts_name("native.panels", streams, nt): copies.linear(native, streams, nt)
            for streams, nt in (PANEL_VARIANTS if max_rows == 1 else ((1, False), (1, True)))}


def candidates(weight_format: str, on_cpu: bool, in_features: int, max_rows: int, native: ModuleType | None,
               packed: bool = False, compute: torch.dtype | None = None) -> dict[str, LinearFn]:
    """The kernels that can run a weight of `weight_format` ("int8", "w8a8", "int4", "w4a8", else a dense dtype) and
    `in_features` columns for batches of up to `max_rows` rows, on the CPU or not; `packed`: offer kernels that read
    a copy of the weight in their own layout (oneDNN's packed dense weights, onednn_packs.py; the panels of
    int4_panels.py, int8_panels.py, bf16_panels.py: each costs the weight's memory again); `compute`: x's dtype (None:
    any, every kernel named)."""
    if weight_format == "w4a8":  # x rounded to int8 per group, then int8 dot products (or the definition's torch ops)
        return w4a8_candidates(native, on_cpu)
    found = _format_candidates(weight_format, on_cpu, in_features, max_rows, native, packed)
    if on_cpu and native is not None and 1 < max_rows <= 64 and compute in (None, torch.bfloat16):
        found.update(batch_candidates(weight_format, in_features, native))
    if (weight_format == "int4" and on_cpu and packed and max_rows <= 64 and compute in (None, torch.bfloat16)
            and hasattr(native, "int4_panel_linear")):  # a copy of W in 16-row panels (int4_panels.py), bf16 x
        found.update(_panel_variants(INT4_PANELS, native, max_rows))
    if (weight_format == "int4" and on_cpu and packed and max_rows > 64 and compute in (None, torch.bfloat16)
            and hasattr(native, "int4_panel_dequantize")):  # prefill from the panel copy: no row layout needed
        found["dequant.panels"] = INT4_PANELS.dequant_linear(native)
    if (weight_format in ("int4", "int8") and on_cpu and packed and max_rows > 8 and compute in (None, torch.bfloat16)
            and hasattr(native, f"{weight_format}_panel_tiled_linear")):  # many rows: the bf16 panels' tiles, converted
        found["native.panels.tiles"] = (INT4_PANELS if weight_format == "int4" else INT8_PANELS).tiled_linear(native)
    if (weight_format == "int8" and on_cpu and packed and max_rows <= 64 and compute in (None, torch.bfloat16)
            and hasattr(native, "int8_panel_linear")):  # a copy of W in 16-row panels (int8_panels.py), bf16 x
        found.update(_panel_variants(INT8_PANELS, native, max_rows))
        if max_rows > 1 and hasattr(native, "int8_panel_pairs_linear"):  # batches: bf16 pair tiles from the copy
            found["native.panels.pairs"] = INT8_PANELS.pairs_linear(native)
        if max_rows > 1 and hasattr(native, "int8_panel_bf16_linear"):  # batches: bf16 pairs a pass, 1 or 2 streams
            for streams in (1, 2):
                for nt in (False, True):
                    found[parts_name("native.panels.bf16", streams, nt)] = INT8_PANELS.bf16_linear(native, streams, nt)
    if (weight_format == "int8" and on_cpu and packed and max_rows > 64 and compute in (None, torch.bfloat16)
            and hasattr(native, "int8_panel_dequantize")):  # prefill from the panel copy: no rows needed
        found["dequant.panels"] = INT8_PANELS.dequant_linear(native)
    if (weight_format == "bfloat16" and on_cpu and packed and compute in (None, torch.bfloat16)
            and hasattr(native, "bf16_panel_linear")):  # a copy of W in 16-row panels (bf16_panels.py), every row count
        found.update(_panel_variants(BF16_PANELS, native, max_rows))
    return found


def _format_candidates(weight_format: str, on_cpu: bool, in_features: int, max_rows: int,
                       native: ModuleType | None, packed: bool) -> dict[str, LinearFn]:
    # many rows on a CPU: also the product in float32 (the 16-bit one is slow where the CPU lacks
    # 16-bit matrix instructions; elsewhere timing drops it)
    upcast = on_cpu and max_rows > 1
    onednn = upcast and ONEDNN_PACKS.supported(torch.float32)  # the float32 products also through oneDNN
    if weight_format == "int4":
        found = {"dequant.linear": _int4_dequant_linear(native)}
        if upcast:
            found["dequant.float32"] = _int4_dequant_linear(native, torch.float32)
        if onednn:
            found["dequant.float32.onednn"] = _int4_dequant_linear(native, torch.float32, onednn_linear)
        if on_cpu and in_features % 64 == 0 and max_rows <= 64:  # torch's wants whole groups, unpadded
            found["torch.int4pack"] = _int4_pack_mm
        if on_cpu and native is not None and max_rows <= 64:
            # streams W, converts per row; with AVX512-BF16 its rows read as parts, prefetched as the x16 kernels'
            for streams, nt in X16_VARIANTS if getattr(native, "int4_linear_reads_parts", False) else ((1, False),):
                found[parts_name("native", streams, nt)] = _native_int4(native.int4_linear, streams, nt)
            if hasattr(native, "int4_x16_linear"):  # built on AVX2 CPUs: x as int16 per group, integer dots
                for streams, nt in X16_VARIANTS:
                    found[parts_name("native.x16", streams, nt)] = _native_int4(native.int4_x16_linear, streams, nt)
            if max_rows > 1:  # dequantizes 16 W rows at a time, then dense bf16 tiles: for batches
                found["native.tiled"] = _native_int4(native.int4_tiled_linear)
        if on_cpu and native is not None and max_rows > 1 and hasattr(native, "tiled_linear"):
            # W dequantized whole (to x's dtype), then the float32 register tiles below (AVX2 hosts)
            found["dequant.tiled"] = _int4_dequant_linear(native, None, _native_tiled(native.tiled_linear))
        return found
    if weight_format == "w8a8" and on_cpu:  # x rounded to int8 per row by every product (w8a8_candidates.py)
        return w8a8_candidates(native, max_rows, in_features)
    if weight_format in ("int8", "w8a8"):  # w8a8 off the CPU: weight-only, as int8 (no dynamic product there)
        found: dict[str, LinearFn] = {"dequant.linear": _int8_dequant_linear()}
        if upcast:
            found["dequant.float32"] = _int8_dequant_linear(torch.float32)
        if onednn:
            found["dequant.float32.onednn"] = _int8_dequant_linear(torch.float32, onednn_linear)
        # torch's weight-only kernel is made for few rows; beyond 64 (prefill) the product is
        # compute-bound and one dequantized dense product wins. It crashes (SIGSEGV, torch 2.13) on
        # widths that are not a multiple of 16.
        if on_cpu and in_features % 32 == 0 and max_rows <= 64:
            found["torch.int8pack"] = _int8_pack_mm
        if on_cpu and native is not None and max_rows <= 64 and hasattr(native, "int8_x16_linear"):
            # built on AVX2 CPUs: x as int16 per 32-column group, integer multiply-adds (int4's likewise)
            for streams, nt in X16_VARIANTS:
                found[parts_name("native.x16", streams, nt)] = _native_int8_x16(native.int8_x16_linear, streams, nt)
        if on_cpu and native is not None and max_rows <= 64 and hasattr(native, "int8_digits_linear"):
            # x in 21-bit fixed point as three int8 rows, w8a8's exact int8 dot tiles (int8_digits_linear.cpp)
            found["native.digits"] = _native_tiled(native.int8_digits_linear)
    else:
        found = {"torch.linear": _torch_linear}
        if on_cpu and max_rows == 1:
            found["torch.mv"] = _torch_mv
        if upcast and weight_format in ("bfloat16", "float16"):
            found["float32.linear"] = _float32_linear()
            if onednn:
                found["float32.onednn"] = _float32_linear(onednn_linear)
        elif onednn and weight_format == "float32":
            found["onednn.linear"] = onednn_linear
        if on_cpu and packed and ONEDNN_PACKS.supported(getattr(torch, weight_format)):
            found["onednn.packed"] = ONEDNN_PACKS.linear
    if on_cpu and native is not None and max_rows <= 64:  # a streaming kernel: only for few rows
        for name, variant in SKINNY_VARIANTS.items():
            found[name] = _native(native, *variant)
    if on_cpu and native is not None and max_rows > 1 and hasattr(native, "tiled_linear"):
        # built on AVX2 CPUs: W read once for all rows, in float32 register tiles (batched decode and prefill)
        found["native.tiled"] = _native_tiled(native.tiled_linear)
    return found
