"""w4a8: int4 weights whose products round the activations to int8 per 32-column group (llama.cpp's Q4
arithmetic) — the rounding's definition, the int8 dot-product kernel against it, every candidate computing the
same model, an answer independent of how many rows shared its step, and accuracy on the trained checkpoint."""

from __future__ import annotations

import pytest
import torch
from test_model_vs_transformers import engine_logits
from test_quantized_engine import teacher_forced

from services import Engine
from services.int4_weight import Int4Weight
from services.kernels.kernel_plan import weight_key
from services.kernels.linear_candidates import candidates
from services.kernels.w4a8_candidates import fake_quantize_groups
from services.quantized_weight import quantize
from services.w4a8_weight import W4A8Weight


def test_the_rounding_is_int8_per_group_of_32_columns():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.54, 0.5, 2.0] + [0.0] * 4 + [0.3]])  # K = 41: 2 groups
    got = fake_quantize_groups(x)
    step = torch.tensor(2.54) / 127  # the second group's largest magnitude -> 127 (a partial group of 9 columns)
    assert got[0, :32].tolist() == [0.0] * 32  # an all-zero group stays zero (no division by its zero maximum)
    assert got[0, 32:].tolist() == (torch.tensor([50, -127, 25, 100, 0, 0, 0, 0, 15]) * step).tolist()
    assert got.dtype == x.dtype and fake_quantize_groups(x.bfloat16()).dtype == torch.bfloat16
    ties = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5]])  # step 1: halves go to the even neighbour
    assert fake_quantize_groups(ties)[0].tolist() == [127.0, 0.0, 2.0, 2.0, -0.0]


def test_the_panels_hold_int4s_values():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(37, 100, generator=g)  # 3 panels, the last with 5 rows; K padded to 128
    int4, panels = Int4Weight.quantize(w), W4A8Weight.quantize(w)
    assert isinstance(panels, Int4Weight) and panels.shape == int4.shape == (37, 100)
    assert panels.packed.shape == (3, 128 * 8) and panels.scale.shape == panels.low.shape == (3, 4 * 16)
    assert torch.equal(panels.levels(), int4.levels())
    assert torch.equal(panels.dequantize(torch.float32), int4.dequantize(torch.float32))
    assert panels.packed[0, 64:68].tolist() == [int(int4.levels()[0, 8 + i]) | int(int4.levels()[0, 12 + i]) << 4
                                                 for i in range(4)]  # octet 1, lane 0: columns 8..11 and 12..15
    # rows past N (lanes 5..15 of the last panel): zeros
    assert panels.scale.view(3, 4, 16)[2, :, 5:].abs().sum() == 0 and panels.packed.view(3, 16, 16, 4)[2, :, 5:].sum() == 0


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 33, 64), (4, 32, 128), (5, 70, 100), (7, 64, 130),
                                                           (25, 16, 64), (13, 96, 257), (100, 40, 1000), (2, 1, 31)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_dot_product_kernel_against_the_definition(native, rows, out_features, in_features, dtype):
    if not hasattr(native, "w4a8_linear"):
        pytest.skip("w4a8_linear is built only where the CPU has AVX512-VNNI, or AVX2, FMA and F16C")
    g = torch.Generator().manual_seed(in_features)
    weight = W4A8Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x = (torch.randn(rows, in_features, generator=g) * 3).to(dtype)
    x[0] = 0  # an all-zero row: only the bias
    bias = torch.randn(out_features, generator=g).to(dtype)
    # x_q exact (int8 x its group's float32 step), not rounded to x's dtype as fake_quantize_groups returns it
    want = fake_quantize_groups(x.float()).double() @ weight.dequantize(torch.float32).double().T + bias.double()
    got = native.w4a8_linear(x, weight.packed, weight.scale, weight.low, out_features, bias)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert got[0].tolist() == bias.tolist()
    # float32: the same sums in another order; bf16: the output rounded once to 8 bits
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (8e-3, 0.05)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    # every row alone (the few-row path) and all together (past 96 rows: the tiled path): bit-identical
    alone = torch.cat([native.w4a8_linear(x[m : m + 1], weight.packed, weight.scale, weight.low, out_features, bias)
                       for m in range(rows)])
    assert torch.equal(alone, got)
    with pytest.raises(RuntimeError, match="bias must have N elements"):
        native.w4a8_linear(x, weight.packed, weight.scale, weight.low, out_features, bias[:-1])
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        native.w4a8_linear(x.half(), weight.packed, weight.scale, weight.low, out_features, None)
    with pytest.raises(RuntimeError, match="packed must be"):
        native.w4a8_linear(x, weight.packed, weight.scale, weight.low, out_features + 16, None)


@pytest.mark.parametrize("on_cpu,with_native", [(True, True), (True, False), (False, False)])
def test_each_host_has_one_w4a8_product_and_it_is_the_definition(native, on_cpu, with_native):
    g = torch.Generator().manual_seed(2)
    weight = quantize(torch.randn(48, 192, generator=g), "w4a8")
    assert isinstance(weight, W4A8Weight) and weight_key(weight) == (48, 192, "w4a8")
    assert weight_key(quantize(torch.randn(48, 192, generator=g), "int4")) == (48, 192, "int4")
    for max_rows, rows in ((1, 1), (8, 5), (64, 33), (1 << 62, 70)):
        found = candidates("w4a8", on_cpu, 192, max_rows, native if with_native else None)
        built = on_cpu and with_native and hasattr(native, "w4a8_linear")
        assert list(found) == ["native.w4a8" if built else "x8.dequant.linear"]  # one model at every row count
        x = torch.randn(rows, 192, generator=g)
        before = x.clone()
        want = fake_quantize_groups(x).double() @ weight.dequantize(torch.float32).double().T
        torch.testing.assert_close(next(iter(found.values()))(x, weight, None).double(), want, rtol=1e-5, atol=1e-4)
        assert torch.equal(x, before)  # x itself is not rounded in place


def test_every_row_count_runs_the_same_product(tiny_path):
    """One prefill of 80 rows, 7-token chunks over a cached prefix, or one token a step run one product, which
    rounds every activation. Their logits still differ a little: the attention sums a prompt in another order
    than a decode step (~1e-6), which can round some activation to the other int8 neighbour a layer later and
    move later logits by up to 0.055 (the AVX2 build on a Zen 4; a CI host: 3.5e-4) — as much as another
    product for some row counts would, so the plan's choices are checked, not the logits' last digits. A product
    that skipped the rounding would put the answer as far away as int4's is: 50x what a flip moves."""
    engine = Engine(tiny_path, dtype="float32", quantization="w4a8", kernels="auto")
    choices = engine.runner.model.plan.linear_choices
    assert {key[-1] for key in choices} == {"w4a8", "int8"}  # lm_head: int8
    assert {len(set(names)) for key, names in choices.items() if key[-1] == "w4a8"} == {1}
    int4 = Engine(tiny_path, dtype="float32", quantization="int4")
    prompt = [5, 6, 7, 8] * 20
    whole = engine_logits(engine, prompt, len(prompt))

    def distance(logits: torch.Tensor) -> float:
        return float((logits - whole).norm() / whole.norm())

    unrounded = distance(engine_logits(int4, prompt, len(prompt)))
    assert 0.005 < unrounded < 0.1, unrounded  # the activations were rounded, by little (0.032)
    for chunk in (7, 1):
        logits = engine_logits(engine, prompt, chunk)
        assert distance(logits) < 0.1 * unrounded, (chunk, distance(logits), unrounded)  # flips: <= 6e-4
        assert (logits.argmax(-1) == whole.argmax(-1)).float().mean() >= 0.95


def test_w4a8_accuracy_on_the_trained_checkpoint(stories_path):
    # stories260K (dim 64, very sensitive): int4's weights move its logprobs by ~2.17 (test_int4_engine); the
    # activations' rounding on top of them, measured against int4: 0.21 (top-1 89%), as bf16's rounding moves the
    # float32 model's by 0.15 (91%)
    full = Engine(stories_path, dtype="float32", kernels="native")
    int4 = Engine(stories_path, dtype="float32", kernels="native", quantization="int4")
    w4a8 = Engine(stories_path, dtype="float32", kernels="native", quantization="w4a8")
    assert isinstance(w4a8.runner.model.layers[0].gate_up, W4A8Weight)  # kept through the huge-page arena
    bf16_error, _ = teacher_forced(full, Engine(stories_path, dtype="bfloat16", kernels="native"))
    rounding_error, rounding_agree = teacher_forced(int4, w4a8)
    assert 0.5 * bf16_error < rounding_error <= 2 * bf16_error, (rounding_error, bf16_error)
    assert rounding_agree >= 0.85
    int4_error, _ = teacher_forced(full, int4)
    error, _ = teacher_forced(full, w4a8)
    assert abs(error - int4_error) <= 0.1 * int4_error, (error, int4_error)  # the weights' error dominates


def test_w4a8_says_when_it_has_no_int8_dot_product_kernel(tiny_path, native, caplog):
    for kernels, warned in (("torch", True), ("native", not hasattr(native, "w4a8_linear"))):
        caplog.clear()
        with caplog.at_level("WARNING", logger="services.kernels.kernel_plan"):
            engine = Engine(tiny_path, dtype="float32", quantization="w4a8", kernels=kernels)
        assert ("w4a8 without its int8 dot-product kernel" in caplog.text) == warned, kernels
        names = {n for key, v in engine.runner.model.plan.linear_choices.items() if key[-1] == "w4a8" for n in v}
        assert names == ({"x8.dequant.linear"} if warned else {"native.w4a8"})
