"""Group-wise int4 weights: the stored layout on a hand example, bounded error, padding, and every kernel
(native, torch's, dequantize-then-linear) against the dequantized reference, chosen by the kernel plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_quantized_weight import X16_SHAPES, assert_within_half_a_step, x16_case, x16_groups

from services.int4_weight import GROUP, Int4Weight
from services.kernels.kernel_plan import KernelPlan
from services.kernels.linear_candidates import candidates
from services.kernels.native import load
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.quantized_weight import quantize

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def test_hand_example_layout():
    # every group of 32 columns holds each level 0..15 twice: scale 1, minimum 0, q = the value itself
    levels = [(5 * c + c // 16) % 16 for c in range(64)]
    w = Int4Weight.quantize(torch.tensor([levels], dtype=torch.float32))
    assert w.scale.tolist() == [[1.0, 1.0]] and w.low.tolist() == [[0.0, 0.0]]
    assert w.levels()[0].tolist() == levels and w.dequantize(torch.float32)[0].tolist() == levels
    # byte 0: column 0 low, column 8 high; byte 8: column 16 low, column 24 high (see BLOCK_ORDER)
    assert w.packed.shape == (1, 32) and w.packed.dtype == torch.uint8
    assert int(w.packed[0, 0]) == levels[0] | levels[8] << 4 == 128
    assert int(w.packed[0, 8]) == levels[16] | levels[24] << 4 == 145
    assert w.nbytes == 32 + 2 * 2 * 2 and w.shape == (1, 64)


def test_error_is_half_a_step_per_group_and_every_group_spans_its_range():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * torch.linspace(0.001, 3, 48)[:, None] + torch.linspace(-1, 1, 48)[:, None]
    q = Int4Weight.quantize(w)
    err = (q.dequantize(torch.float32) - w).abs().view(48, -1, GROUP).amax(dim=2)
    scale = q.scale.float()
    assert bool((err <= scale * (0.5 + 2**-9)).all())  # half a step, and float16's rounding of the scale
    levels = q.levels().view(48, -1, GROUP)[8:]  # the first rows' ranges are below float16's step at their offset
    assert levels.amin(dim=2).eq(0).all() and levels.amax(dim=2).eq(15).all()
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("in_features", [1, 20, 172])
def test_columns_are_padded_to_whole_blocks_by_repeating_the_last(in_features):
    w = torch.randn(3, in_features, generator=torch.Generator().manual_seed(in_features))
    q = Int4Weight.quantize(w)
    padded = -(-in_features // 64) * 64
    assert q.shape == (3, in_features) and q.packed.shape == (3, padded // 2) and q.scale.shape == (3, padded // 32)
    assert q.dequantize(torch.float32).shape == (3, in_features)
    levels, group_end = q.levels(), -(-in_features // GROUP) * GROUP  # the last real column's group's padding:
    assert bool((levels[:, in_features:group_end] == levels[:, in_features - 1 : in_features]).all())  # its level
    step = q.scale.float().repeat_interleave(GROUP, dim=1)[:, :in_features]
    assert bool(((q.dequantize(torch.float32) - w).abs() <= step * (0.5 + 2**-9)).all())


def test_bad_weights_are_refused():
    assert isinstance(quantize(torch.ones(2, 64), "int4"), Int4Weight)
    with pytest.raises(ValueError, match=r"2-D weight \[N, K\] with K > 0, got shape \(4,\)"):
        Int4Weight.quantize(torch.ones(4))
    with pytest.raises(ValueError, match="finite and below 60000"):
        Int4Weight.quantize(torch.tensor([[1.0, float("nan")]]))


@pytest.mark.parametrize("kernel", ["int4_linear", "int4_tiled_linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 1, 20), (1, 7, 64), (3, 33, 172), (5, 16, 200),
                                                           (9, 5, 128), (1, 130, 2048), (13, 37, 256)])
def test_native_int4_linear_is_the_dequantized_product(native, kernel, dtype, rows, out_features, in_features):
    # odd row counts and widths: the tiled kernel's 4 x 4 tiles and 16-row buffers end mid-way
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = Int4Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    got = getattr(native, kernel)(x, weight.packed, weight.scale, weight.low, bias)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    # the tiled kernel multiplies bf16 weights (as dequantize + F.linear does): its reference rounds them too
    weights = weight.dequantize(dtype if kernel == "int4_tiled_linear" else torch.float32).float()
    want = F.linear(x.float(), weights, bias.float())
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])
    if kernel == "int4_linear":  # each thread's rows read as parts (together for one x row, else in turn),
        for streams in (1, 2, 3, 4):  # prefetched past the caches or not: every output computed as before
            for non_temporal in (False, True):
                again = native.int4_linear(x, weight.packed, weight.scale, weight.low, bias, streams, non_temporal)
                assert torch.equal(again, got), (streams, non_temporal)


def x16_reference(x: torch.Tensor, weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """What int4_x16_linear computes, in float64: x as int16 per group (x16_groups), the scaled term on
    that, the offsets on x itself; and the magnitudes of its terms (the two terms cancel, and x's group
    sums are float32 sums: float32's error scales with these, not with the result)."""
    kp = weight.packed.shape[1] * 2
    xq, step = x16_groups(x, kp)
    q = weight.levels().double().view(weight.shape[0], kp // GROUP, GROUP)  # [N, groups, G]
    scaled = torch.einsum("mgc,ngc->mng", xq, q) * weight.scale.double()[None] * step[:, None]  # [M, N, groups]
    groups = F.pad(x.double(), (0, kp - x.shape[1])).view(x.shape[0], -1, GROUP)
    low = weight.low.double().t()
    return scaled.sum(dim=2) + groups.sum(dim=2) @ low, scaled.abs().sum(dim=2) + groups.abs().sum(dim=2) @ low.abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", X16_SHAPES)
def test_native_x16_kernel_is_its_reference(native, dtype, rows, out_features, in_features):
    # built on AVX2 CPUs only: x as int16 per group, q . xq as integer multiply-adds
    if not hasattr(native, "int4_x16_linear"):
        pytest.skip("int4_x16_linear is built only where the CPU has AVX2, FMA and F16C")
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = Int4Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x = x16_case(rows, in_features, g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    got = native.int4_x16_linear(x, weight.packed, weight.scale, weight.low, bias)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want, magnitude = x16_reference(x, weight)
    want += bias.double()
    if dtype == torch.float32:  # float32 sums (31 additions a group: < 2e-6 of the magnitudes) of terms that cancel
        assert bool(((got.double() - want).abs() <= 4e-6 * magnitude + 1e-5).all())
    else:
        torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype], check_dtype=False)
    assert_within_half_a_step(want, x, weight.dequantize(torch.float64), bias)
    for streams in (1, 2, 3, 4):  # each thread's rows read as parts (together for one x row, else in turn),
        for non_temporal in (False, True):  # prefetched past the caches or not: every output computed as before
            again = native.int4_x16_linear(x, weight.packed, weight.scale, weight.low, bias, streams, non_temporal)
            assert torch.equal(again, got)
    assert {"native.x16", "native.x16.4streams", "native.x16.nt", "native.x16.4streams.nt"} <= set(
        candidates("int4", True, in_features, 8, native))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_dequantization_is_the_reference(native, dtype):
    weight = Int4Weight.quantize(torch.randn(9, 172, generator=torch.Generator().manual_seed(1)))
    out = torch.full((9, 172), float("nan"), dtype=dtype)
    got = native.int4_dequantize(weight.packed, weight.scale, weight.low, out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype and got.shape == (9, 172)
    torch.testing.assert_close(got, weight.dequantize(torch.float32).to(dtype), rtol=1e-6 if dtype == torch.float32
                               else None, atol=1e-6 if dtype == torch.float32 else None)


@pytest.mark.parametrize("out_features,in_features", [(9, 172), (33, 2048), (5, 64), (40, 100)])
def test_native_bf16_dequantization_rounds_the_float32_one(native, out_features, in_features):
    """The bf16 output (made from each group's 16 values, int4_block.h's block_bf16) is the float32 output rounded."""
    weight = Int4Weight.quantize(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(3)))
    full = native.int4_dequantize(weight.packed, weight.scale, weight.low, torch.empty(out_features, in_features))
    got = native.int4_dequantize(weight.packed, weight.scale, weight.low,
                                 torch.full((out_features, in_features), float("nan"), dtype=torch.bfloat16))
    assert torch.equal(got, full.bfloat16())


def test_native_refuses_mismatched_shapes(native):
    weight = Int4Weight.quantize(torch.ones(3, 64))
    for kernel in (native.int4_linear, native.int4_tiled_linear):
        with pytest.raises(RuntimeError, match="K within the weight's last 64-column block"):
            kernel(torch.ones(1, 65), weight.packed, weight.scale, weight.low, None)
    with pytest.raises(RuntimeError, match="scale and low must be contiguous float16"):
        native.int4_linear(torch.ones(1, 64), weight.packed, weight.scale.float(), weight.low, None)
    for dtype in (torch.float32, torch.bfloat16):  # refused on every path, the parts-reading one or not
        for streams in (0, 5):
            with pytest.raises(RuntimeError, match=f"streams must be 1 to 4, got {streams}"):
                native.int4_linear(torch.ones(1, 64, dtype=dtype), weight.packed, weight.scale, weight.low, None,
                                   streams)
    with pytest.raises(RuntimeError, match="dequantizes to float32, bfloat16 or float16"):
        native.int4_dequantize(weight.packed, weight.scale, weight.low, torch.empty(3, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU"):
        native.int4_dequantize(weight.packed, weight.scale, weight.low, torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="in_features must lie in the last 64-column block"):
        native.int4_dequantize(weight.packed, weight.scale, weight.low, torch.empty(3, 65, dtype=torch.bfloat16))


@pytest.mark.parametrize("in_features", [40, 64])
@pytest.mark.parametrize("rows", [1, 5, 40, 70])
def test_every_int4_candidate_computes_the_same_product(rows, in_features):
    g = torch.Generator().manual_seed(rows + in_features)
    weight = Int4Weight.quantize(torch.randn(24, in_features, generator=g))  # 24 rows: torch's packing pads to 32
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    found = candidates("int4", True, in_features, {1: 1, 5: 8, 40: 64, 70: 1 << 62}[rows], load())
    assert ("torch.int4pack" in found) == (in_features == 64 and rows <= 64)  # whole groups, few rows
    assert ("native" in found) == (load() is not None and rows <= 64) and "dequant.linear" in found
    assert ("native.tiled" in found) == (load() is not None and 1 < rows <= 64)
    assert ("dequant.tiled" in found) == (rows > 1 and hasattr(load(), "tiled_linear"))
    assert ("native.x16" in found) == (hasattr(load(), "int4_x16_linear") and rows <= 64)
    parts = rows <= 64 and getattr(load(), "int4_linear_reads_parts", False)  # AVX512-BF16 builds
    assert {"native.4streams", "native.nt", "native.4streams.nt"} <= set(found) if parts else "native.nt" not in found
    assert ("dequant.float32.onednn" in found) == (rows > 1 and ONEDNN_PACKS.supported(torch.float32))
    want = F.linear(x.float(), weight.dequantize(torch.float32), bias.float())
    for name, fn in found.items():
        got = fn(x, weight, bias)
        assert got.shape == (rows, 24) and got.dtype == torch.bfloat16, name
        assert (got.float() - want).abs().max() <= 0.02 * want.abs().max(), name  # bf16 rounding


def test_the_plan_chooses_among_the_int4_kernels(monkeypatch, tmp_path):
    from services.kernels import kernel_plan

    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path)
    g = torch.Generator().manual_seed(0)
    weights = [Int4Weight.quantize(torch.randn(32, 64, generator=g)), Int4Weight.quantize(torch.randn(16, 128, generator=g))]
    x = torch.randn(3, 64, generator=g)
    for mode in ("torch", "auto", "native"):
        plan = KernelPlan.choose(weights, (4, 2, 8), torch.float32, torch.device("cpu"), mode)
        assert set(plan.linear_choices) == {(32, 64, "int4"), (16, 128, "int4")}
        for key, names in plan.linear_choices.items():
            for bucket, name in enumerate(names):
                assert name in candidates("int4", True, key[1], kernel_plan.MAX_ROWS[bucket], plan.native), (mode, name)
            if mode == "torch":
                assert "native" not in names
            if mode == "native" and plan.native is not None:
                assert names == ("native", "native", "native", "dequant.linear")
        # x's 3 rows are bucket 2-8: where the plan chose the x16 kernel, its own reference
        rounds_x = plan.linear_choices[(32, 64, "int4")][1].startswith("native.x16")
        want = x16_reference(x, weights[0])[0].float() if rounds_x else F.linear(x, weights[0].dequantize(torch.float32))
        torch.testing.assert_close(plan.linear(x, weights[0]), want, rtol=1e-4, atol=1e-4)
