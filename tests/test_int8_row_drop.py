"""A weight-only int8 weight whose chosen kernels all read its panel copy drops its rows: batches read the copy through
pair_tiled_linear's bf16 pair tiles (int8_panel_pairs_linear: the rows' product bit for bit) and prefill dequantizes W
from it (int8_panel_dequantize: the rows' integers, so dequant.linear's product), so the engine's output does not
change and the weight takes 1 byte a value instead of 2."""

from __future__ import annotations

import pytest
import torch

from services import Engine, SamplingParams
from services.kernels import kernel_plan
from services.kernels.int8_panels import INT8_PANELS, panel_copy
from services.kernels.linear_candidates import candidates
from services.kernels.weight_layouts import (
    PREFER_MARGIN,
    Preference,
    from_panels_alone,
    int8_panels_beside_rows,
    preference,
    reads_panels,
)
from services.quantized_weight import Int8Weight
from services.roofline import ModelCost

SHAPES = [(9, 172), (33, 2048), (5, 64), (40, 100), (16, 8), (17, 1), (48, 96), (70, 129)]


@pytest.fixture
def pairs(native):
    if not hasattr(native, "int8_panel_pairs_linear"):
        pytest.skip("the int8 panel pair tiles are built only where the CPU has AVX512-BF16")
    return native.int8_panel_pairs_linear


def weight_of(out_features: int, in_features: int) -> Int8Weight:
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    return Int8Weight.quantize(torch.randn(out_features, in_features, generator=g))


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_the_copy_dequantizes_to_the_rows_integers(native, pairs, out_features, in_features):
    weight = weight_of(out_features, in_features)
    out = torch.full((out_features, in_features), float("nan"), dtype=torch.bfloat16)
    got = native.int8_panel_dequantize(panel_copy(weight).panels, out_features, out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, weight.qweight.to(torch.bfloat16))


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", [2, 5, 8, 9, 33, 70])
def test_the_pair_tiles_from_the_copy_are_the_rows_product_bit_for_bit(native, pairs, out_features, in_features,
                                                                       rows):
    weight = weight_of(out_features, in_features)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, in_features, generator=g) * torch.randn(rows, 1, generator=g).exp()).bfloat16()
    bias = torch.randn(out_features, generator=g) if rows % 2 else None
    copy = panel_copy(weight)
    got = pairs(x, copy.panels, copy.scale, out_features, bias)
    assert torch.equal(got, native.pair_tiled_linear(x, weight.qweight, weight.scale, None, None, bias))
    exact = (x.double() @ (weight.qweight.double() * weight.scale.double()[:, None]).T
             + (0 if bias is None else bias.double()))
    assert torch.allclose(got.double(), exact, rtol=1e-2, atol=1e-2 * exact.abs().max().item())


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_the_bf16_pass_is_the_product_up_to_float32_rounding_whatever_its_streams(native, out_features, in_features):
    if not hasattr(native, "int8_panel_bf16_linear"):
        pytest.skip("the int8 panels' bf16 pass is built only where the CPU has AVX512-BF16 and VBMI")
    weight, copy = weight_of(out_features, in_features), panel_copy(weight_of(out_features, in_features))
    for rows in (1, 2, 3, 4, 5, 8, 9, 20):
        g = torch.Generator().manual_seed(rows)
        x = (torch.randn(rows, in_features, generator=g) * torch.randn(rows, 1, generator=g).exp()).bfloat16()
        bias = torch.randn(out_features, generator=g) if rows % 2 else None
        got = [native.int8_panel_bf16_linear(x, copy.panels, copy.scale, out_features, bias, streams, nt)
               for streams in (1, 2) for nt in (False, True)]
        assert all(torch.equal(got[0], y) for y in got[1:])  # the same sums in the same order
        exact = (x.double() @ (weight.qweight.double() * weight.scale.double()[:, None]).T
                 + (0 if bias is None else bias.double()))
        assert torch.allclose(got[0].double(), exact, rtol=1e-2, atol=1e-2 * exact.abs().max().item())
    with pytest.raises(RuntimeError, match="streams must be 1 or 2"):
        native.int8_panel_bf16_linear(x, copy.panels, copy.scale, out_features, None, 4, False)
    found = candidates("int8", True, in_features, 8, native, True, torch.bfloat16)
    assert torch.equal(found["native.panels.bf16.2streams"](x[:4], weight, bias),
                       native.int8_panel_bf16_linear(x[:4], copy.panels, copy.scale, out_features, bias, 2, False))


def test_bad_calls_are_refused(native, pairs):
    copy = panel_copy(weight_of(20, 64))
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"out must be a contiguous CPU bfloat16 \[N, K\]"):
        native.int8_panel_dequantize(copy.panels, 20, torch.empty(20, 64))
    with pytest.raises(RuntimeError, match="panels must be"):
        native.int8_panel_dequantize(copy.panels, 20, torch.empty(20, 128, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="panels must be"):
        pairs(x, copy.panels, copy.scale, 40, None)
    with pytest.raises(RuntimeError, match="scale must be"):
        pairs(x, copy.panels, copy.scale[:20], 20, None)
    with pytest.raises(RuntimeError, match="x must be a CPU bf16"):
        pairs(x.float(), copy.panels, copy.scale, 20, None)


def test_the_candidates_read_the_copy_at_every_row_count(native, pairs):
    for max_rows in (8, 64):
        found = candidates("int8", True, 100, max_rows, native, True, torch.bfloat16)
        assert {"native.panels", "native.pairs", "native.panels.pairs"} <= set(found)
    prefill = candidates("int8", True, 100, 1 << 62, native, True, torch.bfloat16)
    assert "dequant.panels" in prefill and "native.panels.pairs" not in prefill
    for fmt, packed, max_rows in (("int8", False, 8), ("int8", False, 1 << 62), ("w8a8", True, 8),
                                  ("w8a8", True, 1 << 62)):  # no copies, or w8a8: none
        found = candidates(fmt, True, 100, max_rows, native, packed, torch.bfloat16)
        assert "native.panels.pairs" not in found and "dequant.panels" not in found
    weight, g = weight_of(40, 100), torch.Generator().manual_seed(7)
    x, bias = torch.randn(70, 100, generator=g).bfloat16(), torch.randn(40, generator=g)
    assert torch.equal(prefill["dequant.panels"](x, weight, bias), prefill["dequant.linear"](x, weight, bias))
    found = candidates("int8", True, 100, 64, native, True, torch.bfloat16)
    assert torch.equal(found["native.panels.pairs"](x[:33], weight, bias), found["native.pairs"](x[:33], weight, bias))


def test_a_weight_without_rows_refuses_every_reader_of_them(native, pairs):
    weight = weight_of(40, 100)
    copy = INT8_PANELS.copy(weight)
    dropped = weight.without_rows()
    INT8_PANELS.rekey(weight, dropped)
    assert (dropped.shape, dropped.nbytes, dropped.rows_dropped) == (weight.shape, weight.nbytes, True)
    assert dropped.qweight.untyped_storage().nbytes() == 1 and dropped.scale is weight.scale
    assert INT8_PANELS.copy(dropped) is copy and not INT8_PANELS.holds(weight)
    for read in (dropped.rows, lambda: dropped.dequantize(torch.bfloat16)):
        with pytest.raises(RuntimeError, match="dropped its rows"):
            read()
    x = torch.randn(1, 100).bfloat16()
    for fn in candidates("int8", True, 100, 1, native, False, torch.bfloat16).values():  # the rows' kernels
        with pytest.raises(RuntimeError):
            fn(x, dropped, None)
    found = candidates("int8", True, 100, 1, native, True, torch.bfloat16)
    assert torch.equal(found["native.panels"](x, dropped, None), found["native.digits"](x, weight, None))


def test_decode_prefers_the_panels_and_prefill_reads_them_only_where_every_decode_bucket_does(native, pairs):
    for rows in (1, 4, 32):
        assert preference((16, 64, "int8"), rows) == Preference(reads_panels, PREFER_MARGIN)
    assert preference((16, 64, "int8"), 128) is None and preference((16, 64, "w8a8"), 4) is None
    panels = ("native.panels.4streams.nt", "native.panels", "native.panels.pairs")
    assert from_panels_alone((8, 64, "int8"), (*panels, "dequant.linear"), native) == (*panels, "dequant.panels")
    for names in [("native.digits", *panels[1:], "dequant.linear"),  # a decode bucket reads the rows: both stay
                  (*panels[:2], "native.pairs", "dequant.linear"),
                  (*panels, "dequant.float32")]:  # not the same W: its own product
        assert from_panels_alone((8, 64, "int8"), names, native) == names
    assert from_panels_alone((8, 64, "w8a8"), (*panels, "dequant.linear"), native) == (*panels, "dequant.linear")


def test_beside_the_rows_the_copy_serves_the_one_row_bucket_only(native, pairs, tmp_path, monkeypatch):
    key = (8, 64, "int8")
    for names in [("native.x16", "native.panels", "native.panels.pairs", "dequant.linear"),
                  ("native.digits", "native.4parts", "native.panels.pairs", "dequant.linear"),
                  ("native.panels", "native.4parts", "native.panels.pairs", "dequant.linear")]:
        assert int8_panels_beside_rows(key, names)
    for names in [("native.panels", "native.4parts", "native.pairs", "dequant.linear"),  # one row only
                  ("native.x16", "native.4parts", "native.pairs", "dequant.linear"),  # no copy
                  ("native.panels", "native.panels", "native.panels.pairs", "dequant.linear")]:  # no rows
        assert not int8_panels_beside_rows(key, names)
    int4 = ("native", "native.panels", "native.panels", "dequant.linear")
    assert not int8_panels_beside_rows((8, 64, "int4"), int4)
    # the plan: 2-8 rows timed to the rows, 9-64 to the copy's pair tiles: 9-64 chosen again without the copy, which
    # stays only where the one-row bucket reads it
    picks = {4: "native.4parts", 32: "native.panels.pairs"}

    def fake(fns, device, rows, before=None, after=None, prefer=None):
        found = (n for n in (picks.get(rows), "native.pairs", "dequant.linear", "native") if n in fns)
        return next(found, next(iter(fns)))

    monkeypatch.setattr(kernel_plan, "_fastest", fake)
    for one, held in (("native.digits", False), ("native.panels", True)):
        picks[1] = one
        monkeypatch.setattr(kernel_plan, "cache_root", lambda folder=tmp_path / one: folder)
        weight = weight_of(48, 96)
        plan = kernel_plan.KernelPlan.choose([weight], (2, 1, 16), torch.bfloat16, torch.device("cpu"))
        assert plan.linear_choices[(48, 96, "int8")] == (one, "native.4parts", "native.pairs", "dequant.linear")
        assert INT8_PANELS.holds(weight) == held and (plan.packed_bytes > 0) == held


def test_the_plan_never_times_the_copys_prefill_product(native, pairs, tmp_path, monkeypatch):
    """dequant.panels ties dequant.linear bit for bit: timed, a tie could keep a copy for prefill alone."""
    offered = []

    def fake(fns, device, rows, before=None, after=None, prefer=None):
        offered.append(set(fns))
        return next(iter(fns))

    monkeypatch.setattr(kernel_plan, "_fastest", fake)
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path)
    kernel_plan.KernelPlan.choose([weight_of(48, 96)], (2, 1, 16), torch.bfloat16, torch.device("cpu"))
    assert any("dequant.linear" in names for names in offered)  # prefill's bucket timed
    assert not any("dequant.panels" in names for names in offered)


def test_the_engine_drops_the_rows_and_answers_the_same(pairs, tiny_path, tmp_path, monkeypatch):
    """Decode forced to the copy's kernels (one row: the digit panels; 2-8 rows: their passes of 4; 9-64: the pair
    tiles) and prefill to dequant.linear, so the rows drop (prefill from the copy), against the same products from
    the rows (int8_digits_linear, pair_tiled_linear, dequant.linear): the same tokens and logprobs, bit for bit."""
    choice = {}

    def forced(fns, device, rows, before=None, after=None, prefer=None):
        return next((n for n in (choice.get(rows), "dequant.linear", "native") if n in fns), next(iter(fns)))

    monkeypatch.setattr(kernel_plan, "_fastest", forced)
    prompts = [[1] + [5 + i % 200 for i in range(90)], [1, 7, 8, 9]]  # 91 tokens: prefill's bucket (65+)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)  # 2 rows a step

    def run(one: str, few: str, batch: str) -> tuple[list, ModelCost, list]:
        choice.update({1: one, 4: few, 32: batch})
        monkeypatch.setattr(kernel_plan, "cache_root", lambda folder=tmp_path / one: folder)
        engine = Engine(model=str(tiny_path), quantization="int8", dtype="bfloat16", num_threads=1, kernels="auto")
        model = engine.runner.model
        weights = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
        rows_dropped = [w.rows_dropped for w in (*weights, model.lm_head)]
        prompt_33 = [[1] + [9 + i % 100 for i in range(32)]]  # 33 rows through the 9-64 bucket
        outputs = engine.generate(prompts, params) + engine.generate(prompt_33, SamplingParams(max_tokens=1))
        return rows_dropped, ModelCost.of(model, 0), [(o.token_ids, o.logprobs) for o in outputs]

    dropped, cost, answers = run("native.panels", "native.panels", "native.panels.pairs")
    kept, cost_kept, again = run("native.digits", "native.digits", "native.pairs")
    assert all(dropped) and not any(kept)
    assert answers == again and cost == cost_kept
