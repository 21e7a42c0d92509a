"""The native tiled product (AVX2 hosts) against torch's, on shapes that cut every tile and panel edge."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.kernels.native import load
from services.quantized_weight import Int8Weight

native = load()
pytestmark = pytest.mark.skipif(not hasattr(native, "tiled_linear"), reason="built only on CPUs with AVX2, FMA, F16C")

# rows: 1, a whole 6-row tile, tiles and a rest; out features: under, at and past a 16-row panel; in
# features: under 8, past a 256-column slice, not a multiple of 8, one whole 1,024-column chunk, chunks and a rest;
# the last: y of 8.7 MB, written past the caches (kStreamBytes)
SHAPES = [(1, 1, 1), (6, 16, 8), (5, 17, 9), (7, 40, 300), (70, 33, 513), (13, 48, 256), (64, 31, 1031),
          (200, 16, 1024), (131, 35, 2309), (133, 16384, 1100)]


@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
def test_float32_is_torchs_product_up_to_summation_order(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    got = native.tiled_linear(x, w, None, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double(), bias.double()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
def test_16_bit_weights_multiply_in_float32_and_round_once(dtype, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows + out_features * in_features)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    got = native.tiled_linear(x, w, None, None)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = F.linear(x.double(), w.double()).to(dtype)  # the exact product, rounded once
    # one rounding step of the result, plus float32 summation's error bound (K * 2^-24 * sum |x w|): a
    # float32 sum can land on the other side of a rounding boundary than the exact one
    step = want.double().abs().clamp(min=2.0**-14) * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
    summation = in_features * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - want.double()).abs() <= step + summation).all()


@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
def test_int8_weights_are_their_values_times_the_row_scale(rows, out_features, in_features):
    g = torch.Generator().manual_seed(3 * rows + in_features)
    weight = Int8Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x, bias = torch.randn(rows, in_features, generator=g), torch.randn(out_features, generator=g)
    got = native.tiled_linear(x, weight.qweight, weight.scale, bias)
    want = F.linear(x.double(), weight.qweight.double() * weight.scale.double()[:, None], bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_bad_shapes_and_dtypes_are_refused():
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\] expected"):
        native.tiled_linear(torch.ones(2, 3), torch.ones(4, 5), None, None)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        native.tiled_linear(torch.ones(2, 3, dtype=torch.float64), torch.ones(4, 3), None, None)
    with pytest.raises(RuntimeError, match="w must be float32, bfloat16, float16 or int8"):
        native.tiled_linear(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.float64), None, None)
    with pytest.raises(RuntimeError, match="a scale goes with int8 weights, and only with them"):
        native.tiled_linear(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.int8), None, None)
    with pytest.raises(RuntimeError, match="one entry per output row"):
        native.tiled_linear(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.int8), torch.ones(3), None)
