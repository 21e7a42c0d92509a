"""Int4 weights' panel copies (services/kernels/int4_panels.py) and their kernel (int4_panel_linear.cpp): the layout
byte by byte, the product against the dequantized reference on odd shapes, bad calls refused, and the kernel plan
keeping a copy only where it chose the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.int4_weight import Int4Weight
from services.kernels import kernel_plan
from services.kernels.cold_cache import ColdCache
from services.kernels.int4_panels import INT4_PANELS, panel_copy
from services.kernels.kernel_plan import KernelPlan
from services.kernels.linear_candidates import candidates
from services.kernels.native import load
from services.kernels.stream_variants import PANEL_VARIANTS, parts_name
from services.weight_arena import HUGE_PAGE, HugePageArena

BF16 = dict(rtol=2e-2, atol=5e-2)  # test_int4_weight.py's bf16 tolerance


@pytest.fixture
def panels_kernel(native):
    if not hasattr(native, "int4_panel_linear"):
        pytest.skip("int4_panel_linear is built only where the CPU has AVX512-BF16")
    return native.int4_panel_linear


def test_the_layout_byte_by_byte():
    # 20 rows: a whole panel and 4 rows of a second; 100 columns: 2 blocks, the last padded
    g = torch.Generator().manual_seed(0)
    weight = Int4Weight.quantize(torch.randn(20, 100, generator=g))
    q = weight.levels()  # [20, 128]
    copy = panel_copy(weight)
    assert copy.packed.shape == (2, 16, 64) and copy.packed.dtype == torch.uint8
    assert copy.scale.shape == copy.low.shape == (2, 4, 16) and copy.scale.dtype == torch.float16
    assert copy.nbytes == 2 * 16 * 64 + 2 * 2 * 4 * 16 * 2
    for p in range(2):
        for o in range(16):
            for lane in range(4):
                for i in range(16):  # the legend of int4_panel_linear.cpp, spelled out
                    row, column = 16 * p + 4 * lane + (i % 8) // 2, 8 * o + 2 * (i >= 8) + i % 2
                    want = int(q[row, column]) | int(q[row, column + 4]) << 4 if row < 20 else 0
                    assert int(copy.packed[p, o, 16 * lane + i]) == want, (p, o, lane, i)
    # by hand: byte 9 of an octet is row 0's columns 3 and 7; byte 63 row 15's columns 3 and 7
    assert int(copy.packed[0, 2, 9]) == int(q[0, 19]) | int(q[0, 23]) << 4
    assert int(copy.packed[0, 0, 63]) == int(q[15, 3]) | int(q[15, 7]) << 4
    for values, panels in ((weight.scale, copy.scale), (weight.low, copy.low)):
        assert torch.equal(panels[0].t(), values[:16]) and torch.equal(panels[1].t()[:4], values[16:])
        assert not panels[1, :, 4:].any()  # the missing rows: zero


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 1, 20), (1, 7, 64), (3, 33, 172), (5, 16, 200),
                                                           (9, 5, 128), (1, 130, 2048), (13, 37, 256), (2, 300, 1000),
                                                           (1, 17, 8192), (4, 18, 160), (6, 21, 96), (8, 16, 64),
                                                           (17, 19, 320), (31, 40, 300)])
def test_the_kernel_is_the_dequantized_product(panels_kernel, rows, out_features, in_features):
    # odd shapes: panels end mid-way, columns end mid-block, rows of x end mid-tile (8 a pass: 1-8 rows each
    # a pass of its own width, 17 and 31 whole passes and a rest)
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = Int4Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    copy = panel_copy(weight)
    got = panels_kernel(x, *copy, out_features, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    want = F.linear(x.float(), weight.dequantize(torch.float32), bias.float())
    torch.testing.assert_close(got.float(), want, **BF16)
    without = panels_kernel(x, *copy, out_features, None)
    torch.testing.assert_close(without.float(), want - bias.float(), **BF16)
    for streams in (1, 2, 4):  # the panels read as parts, prefetched past the caches or not: the same outputs
        for non_temporal in (False, True):
            assert torch.equal(panels_kernel(x, *copy, out_features, bias, streams, non_temporal), got)


def test_bad_calls_are_refused(panels_kernel):
    weight = Int4Weight.quantize(torch.ones(20, 64))
    copy = panel_copy(weight)
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"x must be a CPU bfloat16 \[M, K\]"):
        panels_kernel(x.float(), *copy, 20, None)
    with pytest.raises(RuntimeError, match="packed must be a contiguous CPU uint8"):
        panels_kernel(x, *copy, 40, None)  # 3 panels' worth of rows
    with pytest.raises(RuntimeError, match="packed must be a contiguous CPU uint8"):
        panels_kernel(torch.ones(1, 65, dtype=torch.bfloat16), *copy, 20, None)
    with pytest.raises(RuntimeError, match="scale and low must be contiguous CPU float16"):
        panels_kernel(x, copy.packed, copy.scale.float(), copy.low, 20, None)
    with pytest.raises(RuntimeError, match="bias must have N elements"):
        panels_kernel(x, *copy, 20, torch.ones(19))
    for streams in (0, 3, 8):
        with pytest.raises(RuntimeError, match=f"streams must be 1, 2 or 4, got {streams}"):
            panels_kernel(x, *copy, 20, None, streams)


def test_offered_for_bf16_x_where_copies_fit(panels_kernel):
    native = load()
    one_row = {parts_name("native.panels", s, nt) for s, nt in PANEL_VARIANTS}
    assert len(one_row) == 6 and one_row <= set(candidates("int4", True, 64, 1, native, True, torch.bfloat16))
    assert {"native.panels", "native.panels.nt"} == {
        n for n in candidates("int4", True, 64, 8, native, True, torch.bfloat16) if n.startswith("native.panels")}
    for not_offered in (candidates("int4", True, 64, 1, native, False, torch.bfloat16),  # copies would not fit
                        candidates("int4", True, 64, 1, native, True, torch.float32)):  # float32 x
        assert not any(n.startswith("native.panels") for n in not_offered)
    tiles = {"native.panels.tiles"} if hasattr(native, "int4_panel_tiled_linear") else set()  # AVX512-BF16
    for max_rows in (64, 1 << 62):  # many rows: the tiles on the copy (prefill: no other panel kernel)
        found = {n for n in candidates("int4", True, 64, max_rows, native, True, torch.bfloat16)
                 if n.startswith("native.panels")}
        assert found == ({"native.panels", "native.panels.nt", *tiles} if max_rows == 64 else tiles)


def test_the_plan_keeps_a_copy_only_where_it_chose_the_panels(panels_kernel, tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path)
    g = torch.Generator().manual_seed(5)
    mats = [Int4Weight.quantize(torch.randn(n, k, generator=g)) for n, k in ((48, 64), (32, 128), (48, 64))]

    def panels_win_one_row_of_48x64(fns, device, rows, before=None, after=None, prefer=None):
        for fn in fns.values():  # as timing does: every candidate runs (so the panels' copies are made)
            fn()
        shape = next(iter(fns.values())).args[1].shape
        return "native.panels" if "native.panels" in fns and rows == 1 and shape == (48, 64) else next(
            n for n in fns if not n.startswith("native.panels"))

    monkeypatch.setattr(kernel_plan, "_fastest", panels_win_one_row_of_48x64)
    plan = KernelPlan.choose(mats, (4, 2, 8), torch.bfloat16, torch.device("cpu"), "auto")
    assert plan.linear_choices[(48, 64, "int4")][0] == "native.panels"
    # both 48 x 64 weights hold a copy (the second was never timed); the 32 x 128 one's, made by timing, is dropped
    assert [INT4_PANELS.holds(w) for w in mats] == [True, False, True]
    assert plan.packed_bytes == 2 * panel_copy(mats[0]).nbytes
    for weight in (mats[0], mats[2]):  # kept copies (moved into 2 MB pages where the host allows) hold the layout
        assert all(torch.equal(a, b) for a, b in zip(INT4_PANELS.copy(weight), panel_copy(weight), strict=True))
    x = torch.randn(1, 64).bfloat16()
    torch.testing.assert_close(plan.linear(x, mats[2]).float(), F.linear(x.float(), mats[2].dequantize(torch.float32)),
                               **BF16)
    # where the copies would not fit, the panels are not even timed
    monkeypatch.setattr(kernel_plan, "fits", lambda extra_bytes: False)
    others = [Int4Weight.quantize(torch.randn(48, 64, generator=g))]
    tight = KernelPlan.choose(others, (4, 2, 8), torch.bfloat16, torch.device("cpu"), "auto")
    assert not any(n.startswith("native.panels") for n in tight.linear_choices[(48, 64, "int4")])
    assert tight.packed_bytes == 0 and not INT4_PANELS.holds(others[0])


def test_timing_flushes_a_weights_panel_copy_with_its_own_bytes():
    # the plan times few rows with the weight out of the caches: its panel copy must be out too, or the panels would be
    # timed from the caches against kernels reading from memory
    weight, other = (Int4Weight.quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(s))) for s in (0, 1))
    flushed = []
    cold = ColdCache(1, [weight, other], flush=lambda t: flushed.append(t.data_ptr()))
    cold.evict(weight)
    assert flushed == [weight.packed.data_ptr(), weight.scale.data_ptr(), weight.low.data_ptr()]
    copy = INT4_PANELS.copy(weight)
    flushed.clear()
    cold.evict(weight)
    assert flushed[3:] == [t.data_ptr() for t in copy] and INT4_PANELS.held(other) == ()


def test_a_copy_is_made_in_2mb_pages_of_its_own():
    # the plan times the panels against kernels reading weights already in 2 MB pages (model._into_huge_pages): the copy
    # is placed there when made, not after the choice, and one not kept frees its own mapping
    if HugePageArena.create(1) is None:
        pytest.skip("this platform has no madvise(MADV_HUGEPAGE)")
    weight = Int4Weight.quantize(torch.randn(40, 200, generator=torch.Generator().manual_seed(3)))
    copy = INT4_PANELS.copy(weight)
    assert copy.packed.data_ptr() % HUGE_PAGE == 0  # an arena's start: every page of it can be huge
    assert copy.scale.data_ptr() == copy.packed.data_ptr() + HugePageArena.size_of(copy.packed)
    assert all(torch.equal(a, b) for a, b in zip(copy, panel_copy(weight), strict=True))
    other = INT4_PANELS.copy(Int4Weight.quantize(torch.randn(40, 200, generator=torch.Generator().manual_seed(4))))
    assert other.packed.data_ptr() % HUGE_PAGE == 0 and other.packed.data_ptr() != copy.packed.data_ptr()
