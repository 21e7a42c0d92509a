"""Weight-only int8 weights in 16-row panels (int8_panel_linear.cpp, int8_panels.py): the layout, the product against
int8_digits_linear's (the same exact integer sums, bit for bit) and the float64 one, the candidates, the plan keeping
or dropping the copy, and an engine whose decode reads the panels through the decode chain."""

from __future__ import annotations

import pytest
import torch

from services import Engine, SamplingParams
from services.kernels import kernel_plan
from services.kernels.int8_panels import INT8_PANELS, panel_copy
from services.kernels.linear_candidates import candidates
from services.quantized_weight import Int8Weight

SHAPES = [(9, 172), (33, 2048), (5, 64), (40, 100), (16, 8), (17, 1), (48, 96)]
PANEL_NAMES = ("native.panels", "native.panels.nt", "native.panels.2streams", "native.panels.4streams.nt")


@pytest.fixture
def product(native):
    if not hasattr(native, "int8_panel_linear"):
        pytest.skip("the int8 panel kernel is built only where the CPU has AVX512-VNNI")
    return native.int8_panel_linear


def test_the_copy_lays_out_column_quads_of_16_rows_offset_by_128():
    q = (torch.arange(20 * 10) % 255 - 127).view(20, 10).to(torch.int8)
    copy = panel_copy(Int8Weight(q, torch.arange(1, 21, dtype=torch.float32)))
    assert copy.panels.shape == (2, 16, 16) and copy.panels.dtype == torch.int32  # 10 columns padded to 64: 16 quads
    quads = copy.panels.view(torch.uint8).view(2, 16, 16, 4)
    assert torch.equal(quads[1, 1, 3], (q[19, 4:8].to(torch.int16) + 128).to(torch.uint8))  # panel 1, quad 1, lane 3
    assert torch.equal(quads[1, :, 4:], torch.full((16, 12, 4), 128, dtype=torch.uint8))  # rows past N: the value 0
    assert torch.equal(quads[0, 3:], torch.full((13, 16, 4), 128, dtype=torch.uint8))  # columns past K (12 on)
    assert torch.equal(quads[0, 2, 0, 2:], torch.full((2,), 128, dtype=torch.uint8))
    assert torch.equal(copy.scale, torch.cat([torch.arange(1, 21, dtype=torch.float32), torch.zeros(12)]))


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 70])
def test_the_product_is_the_digit_product_bit_for_bit(native, product, out_features, in_features, rows):
    g = torch.Generator().manual_seed(out_features * in_features + rows)
    w = Int8Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x = (torch.randn(rows, in_features, generator=g) * torch.randn(rows, in_features, generator=g).exp()).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    copy = panel_copy(w)
    answers = [product(x, copy.panels, copy.scale, out_features, bias, streams, nt)
               for streams in (1, 2, 4) for nt in (False, True)]
    assert answers[0].dtype == torch.bfloat16 and answers[0].shape == (rows, out_features)
    assert all(torch.equal(a, answers[0]) for a in answers)  # how W is streamed does not change an integer sum
    assert torch.equal(answers[0], native.int8_digits_linear(x, w.qweight, w.scale, bias))
    w64 = w.dequantize(torch.float64)
    exact = x.double() @ w64.T + bias.double()
    # x in 21-bit fixed point (off by at most 2^-21 of its row's largest) and y rounded once to bf16
    bound = 2**-8 * exact.abs() + 2**-20 * x.double().abs().amax(1, keepdim=True) * w64.abs().sum(1)
    assert ((answers[0].double() - exact).abs() <= bound).all()
    plain = product(x, copy.panels, copy.scale, out_features, None, 1, False)
    assert torch.equal(plain, native.int8_digits_linear(x, w.qweight, w.scale, None))


def test_bad_calls_are_refused(product):
    copy = panel_copy(Int8Weight.quantize(torch.randn(20, 64)))
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a CPU bfloat16"):
        product(x.float(), copy.panels, copy.scale, 20, None, 1, False)
    with pytest.raises(RuntimeError, match=r"panels must be a contiguous CPU int32 \[3, 16, 16\]"):
        product(x, copy.panels, copy.scale, 40, None, 1, False)
    with pytest.raises(RuntimeError, match="panels must be"):
        product(torch.randn(2, 80).bfloat16(), copy.panels, copy.scale, 20, None, 1, False)
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous CPU float32 \[32\]"):
        product(x, copy.panels, copy.scale[:20], 20, None, 1, False)
    with pytest.raises(RuntimeError, match="streams must be 1, 2 or 4"):
        product(x, copy.panels, copy.scale, 20, None, 3, False)
    with pytest.raises(RuntimeError, match="bias must have N elements"):
        product(x, copy.panels, copy.scale, 20, torch.zeros(19), 1, False)


def test_the_candidates_offer_the_panels_for_weight_only_int8_and_bf16_x_where_copies_are_allowed(native, product):
    assert set(PANEL_NAMES) <= set(candidates("int8", True, 64, 1, native, True, torch.bfloat16))
    for max_rows in (8, 64):
        found = candidates("int8", True, 64, max_rows, native, True, torch.bfloat16)
        pairs = {"native.panels.pairs"} if hasattr(native, "int8_panel_pairs_linear") else set()  # AVX512-BF16
        bf16 = ({"native.panels.bf16", "native.panels.bf16.nt", "native.panels.bf16.2streams",
                 "native.panels.bf16.2streams.nt"} if hasattr(native, "int8_panel_bf16_linear") else set())  # and VBMI
        tiles = {"native.panels.tiles"} if max_rows > 8 and hasattr(native, "int8_panel_tiled_linear") else set()
        assert {n for n in found if n.startswith("native.panels")} == {"native.panels", "native.panels.nt", *pairs,
                                                                        *bf16, *tiles}
    for fmt, packed, compute, max_rows in (("int8", False, torch.bfloat16, 1), ("int8", True, torch.float32, 1),
                                           ("w8a8", True, torch.bfloat16, 1)):
        assert not any(n.startswith("native.panels") for n in candidates(fmt, True, 64, max_rows, native, packed,
                                                                          compute))
    prefill = candidates("int8", True, 64, 1 << 62, native, True, torch.bfloat16)  # prefill: the tiles alone
    assert {n for n in prefill if n.startswith("native.panels")} == (
        {"native.panels.tiles"} if hasattr(native, "int8_panel_tiled_linear") else set())


def test_the_plan_keeps_the_copy_only_where_it_chose_the_panels(product, tmp_path, monkeypatch):
    picks = {1: "native.panels.4streams.nt"}

    def fake(fns, device, rows, before=None, after=None, prefer=None):
        pick = picks.get(rows)
        return pick if pick in fns else "dequant.linear" if "dequant.linear" in fns else next(iter(fns))

    monkeypatch.setattr(kernel_plan, "_fastest", fake)
    w = Int8Weight.quantize(torch.randn(48, 96))
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path / "first")
    plan = kernel_plan.KernelPlan.choose([w], (2, 1, 16), torch.bfloat16, torch.device("cpu"))
    assert plan.linear_choices[(48, 96, "int8")][0] == "native.panels.4streams.nt"
    assert INT8_PANELS.holds(w) and plan.packed_bytes >= sum(t.nbytes for t in INT8_PANELS.copy(w))
    x = torch.randn(1, 96).bfloat16()
    copy = INT8_PANELS.copy(w)
    assert torch.equal(plan.linear(x, w), product(x, copy.panels, copy.scale, 48, None, 1, False))
    picks[1] = "dequant.linear"
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path / "second")
    kernel_plan.KernelPlan.choose([w], (2, 1, 16), torch.bfloat16, torch.device("cpu"))
    assert not INT8_PANELS.holds(w)  # timed, not chosen: dropped


def test_an_int8_engine_decoding_through_the_panels_answers_as_the_digit_kernel(product, tiny_path, tmp_path,
                                                                                monkeypatch):
    """Decode (the chain's int8_panels kernel at one row, the panels' several-row pass at 2-8) against the same engine
    forced to int8_digits_linear there: the same integer sums, so the same tokens and logprobs."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    prompts = [[1] + [5 + i % 200 for i in range(30)], [1, 7, 8, 9]]

    def run(first: str) -> tuple[list, bool, bool]:
        # the decode buckets: `first`; prefill's and the attention: the first offered (dequant.linear, native)
        monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path / first)
        monkeypatch.setattr(kernel_plan, "_fastest", lambda fns, *a, **k: next(
            (n for n in (first, "native") if n in fns), next(iter(fns))))
        engine = Engine(model=str(tiny_path), dtype="bfloat16", quantization="int8", num_threads=1, kernels="auto")
        model = engine.runner.model
        held = INT8_PANELS.holds(model.layers[0].gate_up)
        one = [engine.generate([p], params)[0] for p in prompts]  # one row a step
        both = engine.generate(prompts, params)  # two rows a step
        return [(o.token_ids, o.logprobs) for o in (*one, *both)], held, model.chains is not None

    panels, held, chains = run("native.panels.nt")
    digits, held_after, _ = run("native.digits")
    assert held and not held_after and chains
    assert panels == digits
