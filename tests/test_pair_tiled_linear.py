"""The bf16 pair-panel product (AVX512-BF16 hosts) against the exact product, for bf16, int8 and int4 weights, on
shapes that cut every register tile, panel and chunk edge, and where the kernel plan offers it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.int4_weight import Int4Weight
from services.kernels.linear_candidates import candidates
from services.kernels.native import load
from services.quantized_weight import Int8Weight

native = load()
pytestmark = pytest.mark.skipif(not hasattr(native, "pair_tiled_linear"), reason="built only on AVX512-BF16 CPUs")

# rows: 1, under, at and past an 8-row tile, several tiles; out features: under, at and past a 32-row panel; in
# features: 1, odd (a pair with one element), under, at and past a 128-column chunk, several chunks and a rest
SHAPES = [(1, 1, 1), (8, 32, 128), (7, 31, 3), (9, 33, 129), (16, 64, 256), (33, 70, 301), (40, 100, 1000),
          (3, 5, 2047)]


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) in float64, rounded once to bf16: what float32 sums of exact bf16 products round to, up to
    the sums' order."""
    return F.linear(x.double(), w.double(), None if bias is None else bias.double()).bfloat16()


def case(rows: int, out_features: int, in_features: int):
    g = torch.Generator().manual_seed(rows * 1000 + out_features * 10 + in_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g)
    return x, w, torch.randn(out_features, generator=g).bfloat16()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)  # 2 bf16 steps


@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
def test_bf16_weights(rows, out_features, in_features):
    x, w, bias = case(rows, out_features, in_features)
    w = w.bfloat16()
    close(native.pair_tiled_linear(x, w, None, None, None, bias), exact(x, w, bias))


@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
def test_int8_weights_multiply_their_integers_and_scale_the_sums(rows, out_features, in_features):
    x, w, _ = case(rows, out_features, in_features)
    q = Int8Weight.quantize(w)
    got = native.pair_tiled_linear(x, q.qweight, q.scale, None, None, None)
    close(got, (F.linear(x.double(), q.qweight.double()) * q.scale.double()).bfloat16())


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 1, 64), (9, 33, 100), (33, 70, 320), (8, 40, 1000)])
def test_int4_weights_are_the_prefill_paths_bf16_dequantization(rows, out_features, in_features):
    x, w, bias = case(rows, out_features, in_features)
    q = Int4Weight.quantize(w)
    dense = torch.empty(out_features, in_features, dtype=torch.bfloat16)
    native.int4_dequantize(q.packed, q.scale, q.low, dense)  # what int4's prefill path multiplies
    close(native.pair_tiled_linear(x, None, q.scale, q.packed, q.low, bias), exact(x, dense, bias))


def test_bad_arguments_are_refused():
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="CPU bf16"):
        native.pair_tiled_linear(x.float(), torch.ones(3, 4), None, None, None, None)
    with pytest.raises(RuntimeError, match="int8 needs scale"):
        native.pair_tiled_linear(x, torch.ones(3, 4, dtype=torch.int8), None, None, None, None)
    with pytest.raises(RuntimeError, match="contiguous CPU"):
        native.pair_tiled_linear(x, torch.ones(3, 5, dtype=torch.bfloat16), None, None, None, None)
    with pytest.raises(RuntimeError, match="bf16, or int8"):
        native.pair_tiled_linear(x, torch.ones(3, 4, dtype=torch.float16), None, None, None, None)


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8", "int4"])
def test_offered_for_bf16_batches_of_2_to_64_rows(weight_format):
    def offered(max_rows: int, compute: torch.dtype | None) -> bool:
        return "native.pairs" in candidates(weight_format, True, 64, max_rows, native, compute=compute)

    assert offered(8, torch.bfloat16) and offered(64, torch.bfloat16) and offered(64, None)
    assert not offered(1, torch.bfloat16) and not offered(1 << 62, torch.bfloat16) and not offered(64, torch.float32)
    assert "native.pairs" not in candidates("w8a8", True, 64, 64, native, compute=torch.bfloat16)


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8", "int4"])
def test_the_candidate_matches_its_kernel(weight_format):
    x, w, bias = case(9, 33, 128)
    weight = (w.bfloat16() if weight_format == "bfloat16" else Int8Weight.quantize(w) if weight_format == "int8"
              else Int4Weight.quantize(w))
    found = candidates(weight_format, True, 128, 64, native, compute=torch.bfloat16)
    reference = found["torch.linear" if weight_format == "bfloat16" else "dequant.linear"]
    torch.testing.assert_close(found["native.pairs"](x, weight, bias).float(), reference(x, weight, bias).float(),
                               rtol=2e-2, atol=5e-2)
