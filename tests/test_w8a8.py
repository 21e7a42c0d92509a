"""w8a8: int8 weights whose products also round each activation row to int8 (dynamic, symmetric) and
multiply int8 by int8 — the kernel plan's `int8.dynamic` (torch's operators) or `native.w8a8` (the same definition
bit for bit, w8a8_linear.cpp; on CPUs with AMX for 2-64 rows also `native.w8a8.amx`), at every row count on a CPU."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from test_model_vs_transformers import engine_logits
from test_quantized_engine import teacher_forced

from services import Engine
from services.kernels import native
from services.kernels.kernel_plan import weight_key
from services.kernels.linear_candidates import candidates
from services.kernels.w8a8_candidates import _int8_dynamic_mm
from services.quantized_weight import Int8Weight, quantize


def test_the_dynamic_product_is_its_definition():
    g = torch.Generator().manual_seed(3)
    weight = quantize(torch.randn(40, 96, generator=g), "w8a8")
    assert isinstance(weight, Int8Weight) and weight.dynamic_activations and weight_key(weight) == (40, 96, "w8a8")
    product = candidates("w8a8", True, 96, 1 << 62, None)["int8.dynamic"]
    results = []
    for rows, dtype in ((1, torch.float32), (70, torch.float32), (33, torch.bfloat16)):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        x[0] = 0  # an all-zero row stays zero
        before = x.clone()
        x_scale = x.double().abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127
        xq = torch.round(x.double() / x_scale)
        assert xq.abs().max() <= 127
        want = (xq @ weight.qweight.double().T) * x_scale * weight.scale.double()  # exact int products, then scales
        bias = torch.randn(40, generator=g).to(dtype)
        got = product(x, weight, bias)
        assert torch.equal(x, before)  # the input is not rounded in place
        assert got.dtype == dtype and got[0].float().tolist() == bias.float().tolist()
        # bf16: the product and the bias sum are each rounded to 8 bits (outputs reach ~12: ulp 0.0625)
        rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 0.07)
        torch.testing.assert_close(got.double(), (want + bias.double()), rtol=rtol, atol=atol)
        results.append((got, got.clone()))
    assert all(torch.equal(got, kept) for got, kept in results)  # no result lives in the reused buffers


def _assert_the_definition(kernels: list, shapes: tuple, dtype: torch.dtype, g: torch.Generator) -> tuple:
    """Every kernel(x, qweight, scale, bias) gives `_int8_dynamic_mm`'s bits on each (rows, N, K) of `shapes`, with and
    without bias (x scaled by 3, its last row zero when there are more than two); returns the last x, weight, bias."""
    for rows, out_features, in_features in shapes:
        weight = quantize(torch.randn(out_features, in_features, generator=g), "w8a8")
        x = (torch.randn(rows, in_features, generator=g) * 3).to(dtype)
        if rows > 2:
            x[-1] = 0  # an all-zero row: scale 1e-30 / 127, every product 0
        bias = torch.randn(out_features, generator=g).to(dtype)
        for b, kernel in itertools.product((None, bias), kernels):
            got = kernel(x, weight.qweight, weight.scale, b)
            assert got.dtype == dtype and torch.equal(got, _int8_dynamic_mm(x, weight, b)), (rows, in_features, b)
    return x, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_native_kernel_is_the_definition_bit_for_bit(dtype):
    built = native.load()
    if not hasattr(built, "w8a8_linear"):
        pytest.skip("the native w8a8 kernel is built on CPUs with AVX2 or AVX512-VNNI only")
    kernels = [built.w8a8_linear] + ([built.w8a8_panel_linear] if hasattr(built, "w8a8_panel_linear") else [])
    if hasattr(built, "w8a8_row_linear"):  # W streamed row by row, as 1, 2 or 4 parts (AVX512-VNNI builds)
        kernels += [functools.partial(built.w8a8_row_linear, streams=s, non_temporal=nt)
                    for s, nt in itertools.product((1, 2, 4), (False, True))]
    g = torch.Generator().manual_seed(3)
    # odd shapes: K past whole vector steps (64 / 32 columns), 4-column groups and the rows' 4-step rounds, N past
    # whole tiles, 32-row blocks, 12-row groups and 4-part chunks, M past 4-row tiles and 16-row panels (33: a tile of
    # two panels, then one of one); the panels' W rows read in place (K 128, whole groups) and from their copy
    # (K 4,096, K past whole lines, N past whole groups)
    shapes = ((1, 37, 100), (5, 33, 129), (9, 70, 257), (33, 129, 515), (2, 1, 1), (17, 24, 2050), (33, 24, 128),
              (17, 24, 4096), (1, 301, 1000))
    x, weight, bias = _assert_the_definition(kernels, shapes, dtype, g)
    for kernel in kernels:
        with pytest.raises(RuntimeError, match="bias"):
            kernel(x, weight.qweight, weight.scale, bias[:-1])
        with pytest.raises(RuntimeError, match="x float32, bf16 or fp16"):
            kernel(x.double(), weight.qweight, weight.scale, None)
    if hasattr(built, "w8a8_row_linear"):
        with pytest.raises(RuntimeError, match="streams must be 1, 2 or 4, got 3"):
            built.w8a8_row_linear(x, weight.qweight, weight.scale, None, 3, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_tile_unit_product_is_the_definition_bit_for_bit(dtype):
    built = native.load()
    if not hasattr(built, "amx_w8a8_linear") or not built.amx_ready():
        pytest.skip("the tile unit's w8a8 product is built on CPUs with AMX-INT8 only")
    g = torch.Generator().manual_seed(5)
    # rows 1-64 (x tiles cut short; one or two a pass), N past whole 32-row blocks and 16-row tiles, K 64 .. 4,096
    shapes = ((2, 37, 64), (16, 33, 128), (17, 70, 192), (33, 129, 512), (64, 24, 4096), (1, 5, 64), (40, 1, 64))
    x, weight, bias = _assert_the_definition([built.amx_w8a8_linear], shapes, dtype, g)
    # rows with an infinity or a NaN: their outputs' NaNs and infinities are w8a8_linear's own bits (its scalar
    # roundings; the tile product's epilogue rounds 16 lanes at once)
    if hasattr(built, "w8a8_linear"):
        weight = quantize(torch.randn(20, 128, generator=g), "w8a8")
        x = torch.randn(4, 128, generator=g).to(dtype)
        x[1, 7], x[2, 9], x[3, 0] = float("inf"), float("nan"), -float("inf")
        for b in (None, torch.randn(20, generator=g).to(dtype)):
            got = built.amx_w8a8_linear(x, weight.qweight, weight.scale, b)
            want = built.w8a8_linear(x, weight.qweight, weight.scale, b)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            assert got.isnan().any() and torch.equal(got.view(bits), want.view(bits))
    # offered for batches of 2-64 rows whose K is whole steps of 64
    assert "native.w8a8.amx" in candidates("w8a8", True, 128, 8, built)
    assert "native.w8a8.amx" in candidates("w8a8", True, 128, 64, built)
    for in_features, max_rows in ((100, 32), (128, 1), (128, 65)):
        assert "native.w8a8.amx" not in candidates("w8a8", True, in_features, max_rows, built)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        built.amx_w8a8_linear(torch.randn(2, 96).to(dtype), torch.zeros(3, 96, dtype=torch.int8), torch.ones(3), None)
    with pytest.raises(RuntimeError, match="bias"):
        built.amx_w8a8_linear(x, weight.qweight, weight.scale, bias[:-1])
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        built.amx_w8a8_linear(x.double(), weight.qweight, weight.scale, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_int8_product_with_native_rounding_and_scaling_is_the_definition_bit_for_bit(dtype):
    built = native.load()
    if not hasattr(built, "w8a8_round_rows"):
        pytest.skip("w8a8's native rounding is built on CPUs with AVX-512 or AVX2 only")
    g = torch.Generator().manual_seed(4)
    for rows, out_features, in_features in ((1, 37, 100), (5, 33, 129), (33, 129, 515), (2, 1, 1), (17, 24, 2050)):
        weight = quantize(torch.randn(out_features, in_features, generator=g), "w8a8")
        product = candidates("w8a8", True, in_features, 1 << 62, built)["int8.dynamic.native"]
        x = (torch.randn(rows, in_features, generator=g) * 3).to(dtype)
        x[-1] = 0  # an all-zero row: scale 1e-30 / 127, every product 0
        bias = torch.randn(out_features, generator=g).to(dtype)
        for b in (None, bias):
            got = product(x, weight, b)
            assert got.dtype == dtype and torch.equal(got, _int8_dynamic_mm(x, weight, b)), (rows, in_features, b)
        xq, xs = built.w8a8_round_rows(x)
        expected_xs = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-30).div_(127.0)
        assert torch.equal(xs, expected_xs) and torch.equal(xq, (x.float() / expected_xs).round_().to(torch.int8))
    dots = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="bias"):
        built.w8a8_scale_products(dots, torch.ones(2, 1), torch.ones(3), torch.ones(2).to(dtype), x)
    with pytest.raises(RuntimeError, match="xs float32 \\[M, 1\\], scale float32 \\[N\\]"):
        built.w8a8_scale_products(dots, torch.ones(3, 1), torch.ones(3), None, x)
    with pytest.raises(RuntimeError, match="x float32, bf16 or fp16"):
        built.w8a8_round_rows(x.double())


def test_int8_weights_never_get_the_dynamic_kernel_and_w8a8_only_it():
    assert "int8.dynamic" not in candidates("int8", True, 96, 1 << 62, None)
    for max_rows in (1, 8, 64, 1 << 62):  # on a CPU, whatever the row count: one product, one model
        assert list(candidates("w8a8", True, 96, max_rows, None)) == ["int8.dynamic"]
        built = native.load()
        expected = ["int8.dynamic"] + (["int8.dynamic.native"] if hasattr(built, "w8a8_round_rows") else [])
        expected += ["native.w8a8"] if hasattr(built, "w8a8_linear") else []
        if max_rows > 8 and hasattr(built, "w8a8_panel_linear"):  # its other tiles, for many rows (AVX512-VNNI)
            expected.append("native.w8a8.panels")
        if max_rows == 1 and hasattr(built, "w8a8_row_linear"):  # W row by row, for one row (AVX512-VNNI)
            expected += ["native.w8a8.row", "native.w8a8.row.4streams", "native.w8a8.row.nt",
                         "native.w8a8.row.4streams.nt"]
        assert list(candidates("w8a8", True, 96, max_rows, built)) == expected  # the same definition, bit for bit
    assert "int8.dynamic" not in candidates("w8a8", False, 96, 1 << 62, None)  # CPU only (untested elsewhere)


def test_w8a8_accuracy_on_the_trained_checkpoint(stories_path):
    # Measured (dim 64, very sensitive): mean |Δ logprob| bf16 0.159, int8 0.260, w8a8 with every
    # product dynamic 0.387 in float32 (top-1 agreement 90%, 84%, 81%).
    full = Engine(stories_path, dtype="float32", kernels="native")
    bf16_error, _ = teacher_forced(full, Engine(stories_path, dtype="bfloat16", kernels="native"))
    w8a8 = Engine(stories_path, dtype="float32", kernels="native", quantization="w8a8")
    assert w8a8.runner.model.layers[0].gate_up.dynamic_activations  # kept through the huge-page arena
    error, agree = teacher_forced(full, w8a8)
    assert 1.5 * bf16_error < error <= 3 * bf16_error, (error, bf16_error)
    assert agree >= 0.75


def test_w8a8_rounds_the_activations_of_a_prefill_too(tiny_path):
    """(Its decode after a full-precision prefill: test_quantized_engine.)"""
    int8 = Engine(tiny_path, dtype="float32", quantization="int8")
    engine = Engine(tiny_path, dtype="float32", quantization="w8a8")
    prompt = [5, 6, 7, 8] * 20  # 80 rows: the prefill products
    w8a8_logits, int8_logits = engine_logits(engine, prompt, len(prompt)), engine_logits(int8, prompt, len(prompt))
    assert not torch.equal(w8a8_logits, int8_logits)  # the activations were rounded too ...
    relative = float((w8a8_logits - int8_logits).norm() / int8_logits.norm())
    assert relative < 0.08, relative  # ... by little (measured 0.043)


def test_an_answer_does_not_depend_on_how_many_rows_share_its_step(tiny_path):
    """One prefill of 80 rows, 7-token chunks over a cached prefix, or one token a step: the same product, which
    rounds every activation row (a weight-only kernel for the few-row products would round none: int8's logits,
    ~4% away). The attention sums a prompt in another order than a decode step, which can round some activation
    to the other int8 neighbour (test_w4a8), so the logits are held to a tenth of that distance, not to 1e-4."""
    engine = Engine(tiny_path, dtype="float32", quantization="w8a8")
    one = "native.w8a8" if hasattr(native.load(), "w8a8_linear") else "int8.dynamic"  # conftest pins native
    assert all(names == (one,) * 4 for names in engine.runner.model.plan.linear_choices.values())
    prompt = [5, 6, 7, 8] * 20
    whole = engine_logits(engine, prompt, len(prompt))
    unrounded = float((engine_logits(Engine(tiny_path, dtype="float32", quantization="int8"), prompt, len(prompt))
                       - whole).norm() / whole.norm())
    for chunk in (7, 1):
        logits = engine_logits(engine, prompt, chunk)
        assert float((logits - whole).norm() / whole.norm()) < 0.1 * unrounded, chunk
        assert (logits.argmax(-1) == whole.argmax(-1)).float().mean() >= 0.95


def test_w8a8_says_when_the_cpu_has_no_int8_dot_products(tiny_path, monkeypatch, caplog):
    from services.kernels import native

    built = hasattr(native.load(), "w8a8_linear")  # the native kernel runs w8a8 at full speed without them too
    for has_them, warned in ((False, not built), (True, False)):
        monkeypatch.setattr(native, "int8_dot_products", lambda has_them=has_them: has_them)
        caplog.clear()
        with caplog.at_level("WARNING", logger="services.kernels.kernel_plan"):
            Engine(tiny_path, dtype="float32", quantization="w8a8")
        assert ("without int8 dot-product instructions" in caplog.text) == warned
    monkeypatch.setattr(native, "int8_dot_products", lambda: False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="services.kernels.kernel_plan"):
        Engine(tiny_path, dtype="float32", quantization="int8")  # weight-only int8 has fast kernels everywhere
    assert "int8 dot-product" not in caplog.text
