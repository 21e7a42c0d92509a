"""The AMX tile product (CPUs with AMX-BF16) against the exact product, for bf16, int8 and int4 weights, on shapes that cut
every tile edge (16 rows of x, 32 rows of W, two tiles of x a pass), and where the kernel plan offers it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_pair_tiled_linear import case, close, exact

from services.int4_weight import Int4Weight
from services.kernels.linear_candidates import candidates
from services.kernels.native import load
from services.quantized_weight import Int8Weight

native = load()
pytestmark = pytest.mark.skipif(not hasattr(native, "amx_linear"), reason="built only on CPUs with AMX-BF16")

# rows: 1, under, at and past one 16-row tile, two (one pass), three and four (two passes), past; out features:
# under, at and past a 16-row A tile and a 32-row block, several blocks and a rest; in features: one 32-column step,
# several, and the 1b preset's 8,192
SHAPES = [(1, 1, 32), (15, 16, 64), (16, 31, 96), (17, 32, 32), (32, 33, 128), (33, 70, 320), (48, 100, 64),
          (64, 65, 256), (65, 40, 96), (3, 5, 8192)]


@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
def test_bf16_weights(rows, out_features, in_features):
    x, w, bias = case(rows, out_features, in_features)
    w = w.bfloat16()
    close(native.amx_linear(x, w, None, None, bias), exact(x, w, bias))
    close(native.amx_linear(x, w, None, None, None), exact(x, w))


@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
def test_int8_weights_multiply_their_integers_and_scale_the_sums(rows, out_features, in_features):
    x, w, bias = case(rows, out_features, in_features)
    q = Int8Weight.quantize(w)
    want = F.linear(x.double(), q.qweight.double()) * q.scale.double() + bias.double()
    close(native.amx_linear(x, q.qweight, q.scale, None, bias), want.bfloat16())


def test_int8_weights_of_every_value_are_read_exactly():
    """Each of the 256 int8 values (-128 too, which Int8Weight never makes) in every column position of a 64-column
    chunk, and a last half chunk (K = 160): the product of the integers themselves."""
    values = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    w = torch.stack([values.roll(17 * n)[:160] for n in range(40)])  # [40, 160]
    x = torch.randint(-3, 4, (20, 160)).bfloat16()  # small integers: every sum exact in float32 and bf16
    want = F.linear(x.double(), w.double()).bfloat16()
    assert torch.equal(native.amx_linear(x, w, torch.ones(40), None, None), want)


# in features: one 64-column block, half a block past whole blocks (the padded step never read), several blocks
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 1, 64), (9, 33, 96), (33, 70, 320), (8, 40, 1024),
                                                             (64, 65, 2048)])
def test_int4_weights_are_the_prefill_paths_bf16_dequantization(rows, out_features, in_features):
    x, w, bias = case(rows, out_features, in_features)
    q = Int4Weight.quantize(w)
    dense = torch.empty(out_features, in_features, dtype=torch.bfloat16)
    native.int4_dequantize(q.packed, q.scale, q.low, dense)  # what int4's prefill path multiplies
    close(native.amx_linear(x, q.packed, q.scale, q.low, bias), exact(x, dense, bias))


def test_a_non_contiguous_x_is_read_as_its_values():
    x, w, _ = case(20, 40, 128)
    wide = torch.cat([x, x], dim=1)[:, :128]  # x's values, rows 256 apart
    assert not wide.is_contiguous()
    close(native.amx_linear(wide, w.bfloat16(), None, None, None), exact(x, w.bfloat16()))


def test_bad_arguments_are_refused():
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="CPU bf16"):
        native.amx_linear(x.float(), torch.ones(3, 32, dtype=torch.bfloat16), None, None, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.amx_linear(torch.ones(2, 48, dtype=torch.bfloat16), torch.ones(3, 48, dtype=torch.bfloat16), None,
                          None, None)
    with pytest.raises(RuntimeError, match="contiguous CPU"):
        native.amx_linear(x, torch.ones(3, 64, dtype=torch.bfloat16), None, None, None)
    with pytest.raises(RuntimeError, match="bf16, int8 with scale, or int4"):
        native.amx_linear(x, torch.ones(3, 32, dtype=torch.float16), None, None, None)
    with pytest.raises(RuntimeError, match="goes with int8"):
        native.amx_linear(x, torch.ones(3, 32, dtype=torch.int8), None, None, None)
    with pytest.raises(RuntimeError, match="goes with int8"):
        native.amx_linear(x, torch.ones(3, 32, dtype=torch.bfloat16), torch.ones(3), None, None)
    with pytest.raises(RuntimeError, match="float32 \\[N\\]"):
        native.amx_linear(x, torch.ones(3, 32, dtype=torch.int8), torch.ones(4), None, None)
    with pytest.raises(RuntimeError, match="bias must have N"):
        native.amx_linear(x, torch.ones(3, 32, dtype=torch.bfloat16), None, None, torch.ones(4))
    q = Int4Weight.quantize(torch.ones(3, 64))
    with pytest.raises(RuntimeError, match="int4 needs packed, scale and low"):
        native.amx_linear(x, q.packed, None, q.low, None)
    with pytest.raises(RuntimeError, match="within the weight's last 64-column block"):
        native.amx_linear(torch.ones(2, 160, dtype=torch.bfloat16), q.packed, q.scale, q.low, None)


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8", "int4"])
def test_offered_for_bf16_batches_of_2_to_64_rows_with_whole_steps(weight_format):
    def offered(max_rows: int, compute: torch.dtype | None, in_features: int = 64) -> bool:
        return "native.amx" in candidates(weight_format, True, in_features, max_rows, native, compute=compute)

    assert offered(8, torch.bfloat16) and offered(64, torch.bfloat16) and offered(64, None)
    assert not offered(1, torch.bfloat16) and not offered(1 << 62, torch.bfloat16)
    assert not offered(64, torch.float32) and not offered(64, None, 48)
    assert not any("native.amx" in candidates(f, True, 64, 64, native, compute=torch.bfloat16)
                   for f in ("w8a8", "w4a8", "float16"))


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8", "int4"])
def test_the_candidate_matches_its_kernel(weight_format):
    x, w, bias = case(9, 33, 128)
    weight = (w.bfloat16() if weight_format == "bfloat16" else Int8Weight.quantize(w) if weight_format == "int8"
              else Int4Weight.quantize(w))
    found = candidates(weight_format, True, 128, 64, native, compute=torch.bfloat16)
    reference = found["torch.linear" if weight_format == "bfloat16" else "dequant.linear"]
    torch.testing.assert_close(found["native.amx"](x, weight, bias).float(), reference(x, weight, bias).float(),
                               rtol=2e-2, atol=5e-2)
