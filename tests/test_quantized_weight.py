"""Per-channel int8 weights: exact on a hand example, bounded error, the format on the wire of the engine
(quantized decode workers read half the bytes), and the AVX2 kernel that holds x as int16 per group against
its reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.kernels.linear_candidates import candidates
from services.quantized_weight import Int8Weight, quantize

GROUP = 32  # x's rounding groups (services/kernels/x16_groups.h)


def x16_groups(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the x16 kernels hold it, in float64: (xq [M, width / 32, 32], the groups' steps [M, width / 32]);
    width: K padded to whole groups (zeros past K). Largest magnitude -> 32767, halves to even."""
    padded = torch.zeros(x.shape[0], width)
    padded[:, : x.shape[1]] = x.float()
    groups = padded.view(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))  # in float32, as the kernels
    return torch.round(groups * inv).double(), (amax / 32767.0).squeeze(2).double()


# rows, N, K; (1, 45, 100): one x row, each thread's rows in 4 parts read together and a few left over, a partial group
X16_SHAPES = [(1, 1, 20), (1, 7, 64), (3, 33, 172), (5, 16, 200), (1, 130, 2048), (6, 37, 256), (1, 45, 100)]


def x16_case(rows: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """x [rows, in_features] for the x16 kernels' tests: an outlier group in row 0 (its own step, the others keep
    theirs) and, with 3 rows or more, an all-zero row 2 (step 0)."""
    x = torch.randn(rows, in_features, generator=g)
    x[0, :GROUP] *= 40
    if rows > 2:
        x[2] = 0
    return x


def assert_within_half_a_step(want: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor) -> None:
    """want (the x16 product) is off the unrounded product by at most half a step of each x group times the
    weights' magnitudes (dense: the weights in float64, [N, K]), plus float32's ulps of the rounding."""
    width = -(-x.shape[1] // GROUP) * GROUP
    magnitudes = F.pad(dense.abs(), (0, width - x.shape[1])).view(dense.shape[0], -1, GROUP).sum(dim=2)
    full = F.linear(x.double(), dense, bias.double())
    assert bool(((want - full).abs() <= 0.51 * x16_groups(x, width)[1] @ magnitudes.t() + 1e-9).all())


def x16_reference(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """What int8_x16_linear computes: scale[n] * sum_g step[m, g] * (q_g . xq_g), in float64."""
    width = -(-x.shape[1] // GROUP) * GROUP
    xq, step = x16_groups(x, width)
    q = F.pad(weight.qweight.double(), (0, width - x.shape[1])).view(weight.shape[0], -1, GROUP)
    return (torch.einsum("mgc,ngc->mng", xq, q) * step[:, None]).sum(dim=2) * weight.scale.double()


def test_hand_example():
    w = torch.tensor([[1.27, -0.635, 0.0], [0.0, 0.0, 0.0], [-2.54, 1.0, 2.54]])
    q = Int8Weight.quantize(w)
    assert q.qweight.dtype == torch.int8 and q.scale.dtype == torch.float32
    assert q.qweight.tolist() == [[127, -64, 0], [0, 0, 0], [-127, 50, 127]]  # -63.5 rounds to even: -64
    torch.testing.assert_close(q.scale, torch.tensor([0.01, 1.0, 0.02]))
    assert q.shape == (3, 3) and q.nbytes == 9 + 3 * 4


def test_error_is_at_most_half_a_step_per_row():
    w = torch.randn(64, 200, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 64)[:, None]
    q = Int8Weight.quantize(w)
    err = (q.dequantize(torch.float32) - w).abs().amax(dim=1)
    assert bool((err <= q.scale / 2 + 1e-7).all())
    assert q.qweight.abs().amax(dim=1).tolist() == [127] * 64  # every row uses the full range


def test_quantize_names_the_formats():
    w = torch.ones(2, 2)
    assert quantize(w, None) is w
    assert isinstance(quantize(w, "int8"), Int8Weight) and not quantize(w, "int8").dynamic_activations
    assert quantize(w, "w8a8").dynamic_activations
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, w8a8, w4a8 or None, got 'int3'"):
        quantize(w, "int3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", X16_SHAPES)
def test_native_x16_kernel_is_its_reference(native, dtype, rows, out_features, in_features):
    if not hasattr(native, "int8_x16_linear"):
        pytest.skip("int8_x16_linear is built only where the CPU has AVX2, FMA and F16C")
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = Int8Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x = x16_case(rows, in_features, g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    got = native.int8_x16_linear(x, weight.qweight, weight.scale, bias)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = x16_reference(x, weight) + bias.double()
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(got.double(), want, **tolerance)
    assert_within_half_a_step(want, x, weight.dequantize(torch.float64), bias)
    for streams in (1, 2, 3, 4):  # each thread's rows read as parts (together for one x row, else in turn),
        for non_temporal in (False, True):  # prefetched past the caches or not: every output computed as before
            again = native.int8_x16_linear(x, weight.qweight, weight.scale, bias, streams, non_temporal)
            assert torch.equal(again, got)
    # the plan's candidates offer it for int8 weights, few rows (w8a8 keeps its own product)
    assert {"native.x16", "native.x16.4streams", "native.x16.nt", "native.x16.4streams.nt"} <= set(
        candidates("int8", True, in_features, 8, native))
    assert "native.x16" not in candidates("int8", True, in_features, 65, native)
    assert "native.x16" not in candidates("w8a8", True, in_features, 8, native)


def test_native_x16_kernel_refuses_mismatched_shapes(native):
    if not hasattr(native, "int8_x16_linear"):
        pytest.skip("int8_x16_linear is built only where the CPU has AVX2, FMA and F16C")
    weight = Int8Weight.quantize(torch.ones(3, 40))
    with pytest.raises(RuntimeError, match="x \\[M, K\\] expected, K = 40"):
        native.int8_x16_linear(torch.ones(1, 41), weight.qweight, weight.scale, None)
    with pytest.raises(RuntimeError, match="scale must be a contiguous float32"):
        native.int8_x16_linear(torch.ones(1, 40), weight.qweight, weight.scale.half(), None)
    with pytest.raises(RuntimeError, match="w must be a contiguous CPU int8"):
        native.int8_x16_linear(torch.ones(1, 40), weight.qweight.float(), weight.scale, None)
    for streams in (0, 5):
        with pytest.raises(RuntimeError, match=f"streams must be 1 to 4, got {streams}"):
            native.int8_x16_linear(torch.ones(1, 40), weight.qweight, weight.scale, None, streams)


def x_digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as int8_digits_linear holds it (services/kernels/x_digits.h): (X [M, K] integers, u [M]) in float64,
    X = round(x / u) (halves to even), u = 2^-14 times the least power of two p (>= 2^-100) with 127 p >= max |x|."""
    units = []
    for amax in x.float().abs().amax(dim=1).tolist():
        p = 2.0 ** -100
        while 127 * p < amax:
            p *= 2
        units.append(p * 2.0 ** -14 if amax > 0 else 1.0)
    u = torch.tensor(units, dtype=torch.float64)
    return torch.round(x.double() / u[:, None]), u


def digits_reference(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """What int8_digits_linear computes: the exact integer dot D = X . q, then float32(D) * u * scale (+ bias), rounded
    once to x's dtype."""
    X, u = x_digits(x)
    D = X @ weight.qweight.double().t()  # integers below 2^53: exact
    y = D.float() * u.float()[:, None] * weight.scale
    return (y if bias is None else y + bias.float()).to(x.dtype)


def digits_native(native):
    if not hasattr(native, "int8_digits_linear"):
        pytest.skip("int8_digits_linear is built only where the CPU has AVX512-VNNI or AVX2")
    return native.int8_digits_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,out_features,in_features", X16_SHAPES + [(9, 70, 333), (2, 3, 64)])
def test_native_digits_kernel_is_its_definition(native, dtype, rows, out_features, in_features):
    kernel = digits_native(native)
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = Int8Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x = x16_case(rows, in_features, g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    for b in (None, bias):
        got = kernel(x, weight.qweight, weight.scale, b)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        assert torch.equal(got, digits_reference(x, weight, b))
    # x is off by at most half its unit: the product by at most half a unit times the weights' magnitudes
    full = F.linear(x.double(), weight.dequantize(torch.float64), bias.double())
    X, u = x_digits(x)
    assert bool(((X * u[:, None] - x.double()).abs() <= u[:, None] / 2).all())
    if dtype == torch.float32:
        bound = 0.5 * u[:, None] * (weight.qweight.double().abs() @ torch.ones(in_features, dtype=torch.float64))
        assert bool(((got.double() - full).abs() <= bound * weight.scale.double() + 1e-5 * full.abs() + 1e-6).all())
    # the plan offers it for int8 weights, few rows (w8a8 keeps its own product)
    assert "native.digits" in candidates("int8", True, in_features, 8, native)
    assert "native.digits" not in candidates("int8", True, in_features, 65, native)
    assert "native.digits" not in candidates("w8a8", True, in_features, 8, native)


def test_native_digits_hold_bf16_rows_exactly(native):
    # every element within 2^12 of its row's largest: x is exact, so with float32 outputs and unit scales y is the
    # exact product rounded once to float32
    kernel = digits_native(native)
    g = torch.Generator().manual_seed(5)
    magnitudes = 2.0 ** (-12 * torch.rand(4, 300, generator=g))  # in (2^-12, 1]
    signs = torch.randint(0, 2, (4, 300), generator=g) * 2 - 1
    x = (magnitudes * signs * torch.tensor([[1.0], [3e5], [7e-20], [1e30]])).bfloat16().float()
    q = torch.randint(-127, 128, (50, 300), generator=g, dtype=torch.int8)
    weight = Int8Weight(q, torch.ones(50))
    exact = (x.double() @ q.double().t()).float()
    assert torch.equal(kernel(x, weight.qweight, weight.scale, None), exact)


def test_native_digits_rows_with_an_infinity_or_a_nan_give_nans(native):
    kernel = digits_native(native)
    g = torch.Generator().manual_seed(6)
    weight = Int8Weight.quantize(torch.randn(20, 100, generator=g))
    x = torch.randn(4, 100, generator=g)
    x[1, 7], x[2, 99], x[3, 40] = float("inf"), float("nan"), -float("inf")  # 99: past the whole vectors
    got = kernel(x, weight.qweight, weight.scale, None)
    assert got[1:].isnan().all() and torch.equal(got[0], kernel(x[:1], weight.qweight, weight.scale, None)[0])
    assert not got[0].isnan().any()


def test_native_digits_kernel_refuses_mismatched_shapes(native):
    kernel = digits_native(native)
    weight = Int8Weight.quantize(torch.ones(3, 40))
    with pytest.raises(RuntimeError, match="x and w must share K"):
        kernel(torch.ones(1, 41), weight.qweight, weight.scale, None)
    with pytest.raises(RuntimeError, match="K must be 1 to 65,536 columns"):
        wide = Int8Weight.quantize(torch.ones(1, 65537))
        kernel(torch.ones(1, 65537), wide.qweight, wide.scale, None)
    with pytest.raises(RuntimeError, match="scale must be a contiguous float32"):
        kernel(torch.ones(1, 40), weight.qweight, weight.scale.half(), None)
    with pytest.raises(RuntimeError, match="w must be a contiguous CPU int8"):
        kernel(torch.ones(1, 40), weight.qweight.float(), weight.scale, None)
    with pytest.raises(RuntimeError, match="bias must have N elements"):
        kernel(torch.ones(1, 40), weight.qweight, weight.scale, torch.ones(4))
