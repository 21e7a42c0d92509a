"""An int4 weight whose chosen kernels all read its panel copy drops its row layout: prefill dequantizes W from the
panels (int4_panel_dequantize.cpp), bit for bit the row layout's W, so the engine's output does not change and the
weight takes 0.625 bytes a value instead of twice that."""

from __future__ import annotations

import pytest
import torch

from services import Engine, SamplingParams
from services.int4_weight import Int4Weight
from services.kernels import kernel_plan
from services.kernels.int4_panels import INT4_PANELS, panel_copy
from services.kernels.linear_candidates import candidates
from services.kernels.weight_layouts import from_panels_alone
from services.roofline import ModelCost

SHAPES = [(9, 172), (33, 2048), (5, 64), (40, 100), (16, 8), (17, 1), (48, 96)]


@pytest.fixture
def dequantize(native):
    if not hasattr(native, "int4_panel_dequantize"):
        pytest.skip("the int4 panel kernels are built only where the CPU has AVX512-BF16")
    return native.int4_panel_dequantize


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_the_panels_dequantize_to_the_row_layouts_w(native, dequantize, out_features, in_features):
    weight = Int4Weight.quantize(torch.randn(out_features, in_features,
                                             generator=torch.Generator().manual_seed(out_features * in_features)))
    copy = panel_copy(weight)
    out = torch.full((out_features, in_features), float("nan"), dtype=torch.bfloat16)
    got = dequantize(copy.packed, copy.scale, copy.low, out_features, out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, native.int4_dequantize(weight.packed, weight.scale, weight.low, torch.empty_like(out)))


def test_bad_calls_are_refused(dequantize):
    copy = panel_copy(Int4Weight.quantize(torch.randn(20, 64)))
    with pytest.raises(RuntimeError, match=r"out must be a contiguous CPU bfloat16 \[N, K\]"):
        dequantize(copy.packed, copy.scale, copy.low, 20, torch.empty(20, 64))
    with pytest.raises(RuntimeError, match="packed must be"):
        dequantize(copy.packed, copy.scale, copy.low, 20, torch.empty(20, 128, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed must be"):
        dequantize(copy.packed, copy.scale, copy.low, 40, torch.empty(40, 64, dtype=torch.bfloat16))


def test_the_prefill_product_from_the_panels_is_the_row_layouts_bit_for_bit(native, dequantize):
    found = candidates("int4", True, 100, 1 << 62, native, True, torch.bfloat16)
    assert "dequant.panels" in found
    assert "dequant.panels" not in candidates("int4", True, 100, 1 << 62, native, False, torch.bfloat16)  # no copies
    assert "dequant.panels" not in candidates("int4", True, 100, 64, native, True, torch.bfloat16)  # decode buckets
    g = torch.Generator().manual_seed(7)
    weight = Int4Weight.quantize(torch.randn(40, 100, generator=g))
    x, bias = torch.randn(70, 100, generator=g).bfloat16(), torch.randn(40, generator=g)
    assert torch.equal(found["dequant.panels"](x, weight, bias), found["dequant.linear"](x, weight, bias))


def test_a_weight_without_rows_refuses_every_reader_of_them(native, dequantize):
    weight = Int4Weight.quantize(torch.randn(40, 100, generator=torch.Generator().manual_seed(2)))
    copy = INT4_PANELS.copy(weight)
    dropped = weight.without_rows()
    INT4_PANELS.rekey(weight, dropped)
    assert (dropped.shape, dropped.nbytes, dropped.rows_dropped) == (weight.shape, weight.nbytes, True)
    assert [t.untyped_storage().nbytes() for t in (dropped.packed, dropped.scale, dropped.low)] == [1, 2, 2]
    assert INT4_PANELS.copy(dropped) is copy
    with pytest.raises(RuntimeError, match="dropped its row layout"):
        dropped.levels()
    with pytest.raises(RuntimeError, match="packed must be"):
        native.int4_linear(torch.randn(1, 100).bfloat16(), dropped.packed, dropped.scale, dropped.low, None)


def test_prefill_reads_the_panels_only_where_every_decode_bucket_does(native, dequantize):
    panels = ("native.panels.2streams", "native.panels", "native.panels.nt")
    assert from_panels_alone((8, 64, "int4"), (*panels, "dequant.linear"), native) == (*panels, "dequant.panels")
    for names in [("native.x16", *panels[1:], "dequant.linear"),  # a decode bucket reads the rows: both stay
                  (*panels, "dequant.float32")]:  # not the same W: its own product
        assert from_panels_alone((8, 64, "int4"), names, native) == names
    assert from_panels_alone((8, 64, "w4a8"), (*panels, "dequant.linear"), native) == (*panels, "dequant.linear")
    assert from_panels_alone((8, 64, "int4"), (*panels, "dequant.linear"), None) == (*panels, "dequant.linear")


def test_the_engine_drops_the_rows_and_answers_the_same(dequantize, tiny_path, tmp_path, monkeypatch):
    """The plan forced (decode: the panels; prefill: the row layout's dequantize): with the rows dropped (prefill from
    the panels) and kept (the substitution undone), the same tokens and logprobs, bit for bit."""
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path)

    def panels_for_decode(fns, device, rows, before=None, after=None, prefer=None):
        return "native.panels" if "native.panels" in fns else "dequant.linear" if "dequant.linear" in fns else next(
            iter(fns))

    monkeypatch.setattr(kernel_plan, "_fastest", panels_for_decode)
    prompts = [[1] + [5 + i % 200 for i in range(90)], [1, 7, 8, 9]]  # 91 tokens: prefill's bucket (65+)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)

    def run() -> tuple[list, ModelCost, list]:
        engine = Engine(model=str(tiny_path), quantization="int4", dtype="bfloat16", num_threads=1, kernels="auto")
        layers = engine.runner.model.layers
        dropped = [getattr(layer, n).rows_dropped for layer in layers for n in ("qkv", "o", "gate_up", "down")]
        cost = ModelCost.of(engine.runner.model, 0)  # the bytes a step reads: the panel copy's, as many
        return dropped, cost, [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]

    dropped, cost, answers = run()
    monkeypatch.setattr(kernel_plan, "from_panels_alone", lambda key, names, native: names)
    kept, cost_kept, again = run()
    assert all(dropped) and not any(kept)
    assert answers == again and cost == cost_kept
