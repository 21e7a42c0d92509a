"""Many rows from an int8 or int4 weight's panel copy (panel_tiled_linear.cpp, `native.panels.tiles`): two panels
converted into bf16 pairs a pass, the bf16 panels' register tiles over every row — pair_tiled_linear's product on the
weight's rows (`native.pairs`) bit for bit, so a prefill read from the copy changes no answer; the plan keeps a copy
for it only where the copy is held for decode anyway."""

from __future__ import annotations

import pytest
import torch

from services import Engine, SamplingParams
from services.int4_weight import Int4Weight
from services.kernels import kernel_plan
from services.kernels.int4_panels import INT4_PANELS
from services.kernels.int8_panels import INT8_PANELS
from services.kernels.linear_candidates import candidates
from services.kernels.weight_layouts import panels_for_prefill_alone
from services.quantized_weight import Int8Weight

SHAPES = [(9, 172), (33, 2048), (5, 64), (40, 100), (16, 8), (17, 1), (48, 96), (70, 129)]
ROWS = [1, 3, 8, 9, 17, 70, 130]
FORMATS = {"int8": (Int8Weight, INT8_PANELS), "int4": (Int4Weight, INT4_PANELS)}


@pytest.fixture
def tiles(native):
    if not hasattr(native, "int8_panel_tiled_linear"):
        pytest.skip("the panel tiles are built only where the CPU has AVX512-BF16")
    return native


def weight_of(fmt: str, out_features: int, in_features: int) -> Int8Weight | Int4Weight:
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    return FORMATS[fmt][0].quantize(torch.randn(out_features, in_features, generator=g))


def rows_product(native, x: torch.Tensor, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, Int8Weight):
        return native.pair_tiled_linear(x, weight.qweight, weight.scale, None, None, bias)
    return native.pair_tiled_linear(x, None, weight.scale, weight.packed, weight.low, bias)


def tiles_product(native, x: torch.Tensor, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, Int8Weight):
        copy = INT8_PANELS.copy(weight)
        return native.int8_panel_tiled_linear(x, copy.panels, copy.scale, weight.shape[0], bias)
    return native.int4_panel_tiled_linear(x, *INT4_PANELS.copy(weight), weight.shape[0], bias)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_the_tiles_are_the_rows_pair_tiles_bit_for_bit(tiles, fmt, out_features, in_features, rows):
    weight = weight_of(fmt, out_features, in_features)
    g = torch.Generator().manual_seed(rows)
    # rows of mixed magnitude: a sum's order shows in its last bits
    x = (torch.randn(rows, in_features, generator=g) * torch.randn(rows, 1, generator=g).exp()).bfloat16()
    bias = torch.randn(out_features, generator=g) if rows % 2 else None
    got = tiles_product(tiles, x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert torch.equal(got, rows_product(tiles, x, weight, bias))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tiles_are_the_product_within_bf16_rounding(tiles, fmt):
    weight = weight_of(fmt, 40, 300)
    x = torch.randn(70, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    real = weight.dequantize(torch.float32).double() if fmt == "int8" else weight.dequantize(torch.bfloat16).double()
    exact = x.double() @ real.T
    got = tiles_product(tiles, x, weight, None).double()
    assert ((got - exact).abs() <= 1e-2 * exact.abs() + 1e-2).all()


def test_bad_calls_are_refused(tiles):
    weight = weight_of("int8", 20, 100)
    copy = INT8_PANELS.copy(weight)
    x = torch.randn(3, 100).bfloat16()
    with pytest.raises(RuntimeError, match=r"panels must be a contiguous CPU int32 \[2, 16, 16\]"):
        tiles.int8_panel_tiled_linear(x[:, :64], copy.panels, copy.scale, 20, None)
    with pytest.raises(RuntimeError, match="x must be a CPU bfloat16"):
        tiles.int8_panel_tiled_linear(x.float(), copy.panels, copy.scale, 20, None)
    with pytest.raises(RuntimeError, match="scale must be a contiguous CPU float32"):
        tiles.int8_panel_tiled_linear(x, copy.panels, copy.scale[:16], 20, None)
    with pytest.raises(RuntimeError, match="bias must have N elements"):
        tiles.int8_panel_tiled_linear(x, copy.panels, copy.scale, 20, torch.zeros(19))
    packed, scale, low = INT4_PANELS.copy(weight_of("int4", 20, 100))
    with pytest.raises(RuntimeError, match="packed must be a contiguous CPU uint8"):
        tiles.int4_panel_tiled_linear(x, packed, scale, low, 40, None)
    with pytest.raises(RuntimeError, match="scale and low must be contiguous CPU float16"):
        tiles.int4_panel_tiled_linear(x, packed, scale.float(), low, 20, None)
    assert tiles.int8_panel_tiled_linear(x[:0], copy.panels, copy.scale, 20, None).shape == (0, 20)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_candidate_reads_the_copy_from_9_rows_on(tiles, fmt):
    for max_rows in (64, 1 << 62):
        assert "native.panels.tiles" in candidates(fmt, True, 100, max_rows, tiles, True, torch.bfloat16)
    for max_rows, packed, compute in ((8, True, torch.bfloat16), (1, True, torch.bfloat16),
                                      (1 << 62, False, torch.bfloat16), (1 << 62, True, torch.float32)):
        assert "native.panels.tiles" not in candidates(fmt, True, 100, max_rows, tiles, packed, compute)
    for other in ("w8a8", "w4a8", "bfloat16"):
        assert "native.panels.tiles" not in candidates(other, True, 100, 1 << 62, tiles, True, torch.bfloat16)
    weight = weight_of(fmt, 40, 100)
    found = candidates(fmt, True, 100, 64, tiles, True, torch.bfloat16)
    x, bias = torch.randn(33, 100, generator=torch.Generator().manual_seed(5)).bfloat16(), torch.randn(40)
    expected = found["native.pairs"](x, weight, bias)
    copies = FORMATS[fmt][1]
    copies.copy(weight)
    dropped = weight.without_rows()  # the copy alone: the tiles need no rows
    copies.rekey(weight, dropped)
    assert torch.equal(found["native.panels.tiles"](x, dropped, bias), expected)


def test_a_copy_is_not_kept_for_prefill_alone():
    tiles_only = ("native.digits", "native.4parts", "native.pairs", "native.panels.tiles")
    for fmt in ("int4", "int8"):
        assert panels_for_prefill_alone((8, 64, fmt), tiles_only)
        for names in [("native.panels", "native.4parts", "native.pairs", "native.panels.tiles"),  # held for one row
                      ("native.digits", "native.4parts", "native.pairs", "dequant.linear"),  # no copy
                      ("native.panels", "native.panels", "native.panels.tiles", "native.panels.tiles")]:
            assert not panels_for_prefill_alone((8, 64, fmt), names)
    assert not panels_for_prefill_alone((8, 64, "bfloat16"), ("native", "native", "native", "native.panels"))


@pytest.mark.parametrize("one,held,prefill", [("native.digits", False, "dequant.linear"),
                                              ("native.panels", True, "native.panels.tiles")])
def test_the_plan_reads_prefill_from_the_copy_only_where_decode_holds_it(tiles, tmp_path, monkeypatch, one, held,
                                                                         prefill):
    """Timed: prefill to the tiles, 2-64 rows to the rows' kernels, one row to `one`: the tiles stay only where the
    one-row bucket holds the copy anyway (an int8 copy beside its rows serves one row and prefill)."""
    picks = {1: one, 4: "native.4parts", 32: "native.panels.pairs", 128: "native.panels.tiles"}

    def fake(fns, device, rows, before=None, after=None, prefer=None):
        found = (n for n in (picks.get(rows), "native.pairs", "dequant.linear", "native") if n in fns)
        return next(found, next(iter(fns)))

    monkeypatch.setattr(kernel_plan, "_fastest", fake)
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path)
    weight = weight_of("int8", 48, 96)
    plan = kernel_plan.KernelPlan.choose([weight], (2, 1, 16), torch.bfloat16, torch.device("cpu"))
    assert plan.linear_choices[(48, 96, "int8")] == (one, "native.4parts", "native.pairs", prefill)
    assert INT8_PANELS.holds(weight) == held


@pytest.mark.parametrize("fmt,batch", [("int8", "native.panels.pairs"), ("int4", "native.pairs")])
def test_the_engine_prefills_from_the_copy_and_answers_as_the_pair_tiles(tiles, tiny_path, tmp_path, monkeypatch,
                                                                         fmt, batch):
    """Decode's small buckets on the copy; 9-64 rows on the tiles or on the pair tiles (their product bit for bit);
    prefill (65+) on the tiles: the same tokens and logprobs, and with every bucket on the copy the rows drop."""
    choice = {}

    def forced(fns, device, rows, before=None, after=None, prefer=None):
        return next((n for n in (choice.get(rows), "dequant.linear") if n in fns), next(iter(fns)))

    monkeypatch.setattr(kernel_plan, "_fastest", forced)
    prompts = [[1] + [5 + i % 200 for i in range(90)], [1] + [9 + i % 100 for i in range(32)]]  # 91 and 33 rows
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)

    def run(nine_to_64: str) -> tuple[list, list]:
        choice.update({1: "native.panels", 4: "native.panels", 32: nine_to_64, 128: "native.panels.tiles"})
        monkeypatch.setattr(kernel_plan, "cache_root", lambda folder=tmp_path / nine_to_64: folder)
        engine = Engine(model=str(tiny_path), quantization=fmt, dtype="bfloat16", num_threads=1, kernels="auto")
        model = engine.runner.model
        # (int4's lm_head is int8: beside its rows, kept by native.pairs, its copy serves one row and prefill)
        assert {names for key, names in model.plan.linear_choices.items() if key[-1] == fmt} == {
            ("native.panels", "native.panels", nine_to_64, "native.panels.tiles")}
        weights = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
        dropped = [w.rows_dropped for w in (*weights, model.lm_head)]
        outputs = [engine.generate([p], params)[0] for p in prompts]  # each prompt alone: 91 and 33 prefill rows
        return dropped, [(o.token_ids, o.logprobs) for o in outputs]

    dropped, answers = run("native.panels.tiles")
    dropped_too, again = run(batch)
    assert all(dropped) and all(dropped_too) == (fmt == "int8")
    assert answers == again
