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
