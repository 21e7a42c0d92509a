"""The decoder's element-wise glue (services/kernels/decoder_glue.*): the native pass against torch's
operators in Hugging Face's order, on odd shapes, in every dtype."""

from __future__ import annotations

import pytest
import torch

from services.kernels.decoder_glue import DecoderGlue, rms_norm
from services.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def random(shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 7), (5, 96), (3, 100), (33, 2048)])
def test_residual_norm_matches_the_torch_chain(native, dtype, rows, width):
    h, delta, weight = random((rows, width), dtype, 0), random((rows, width), dtype, 1), random((width,), dtype, 2) + 1
    want_h = h + delta
    want = rms_norm(want_h, weight, 1e-5)
    got_h, got = DecoderGlue(native).residual_norm(h, delta, weight, 1e-5)
    assert got_h.data_ptr() == h.data_ptr()  # the residual stream, updated in place
    assert torch.equal(got_h, want_h)  # the add rounds exactly as torch's does
    # only the sum of squares is summed otherwise (in double): a few float32 steps at most, then at
    # most one step of a 16-bit dtype after the normalisation and one more from the weight's product
    torch.testing.assert_close(got.float(), want.float(), rtol=max(2 * ULP[dtype], 4e-7), atol=1e-6)
    if dtype != torch.float32:  # a last-bit difference of the float32 scale rarely survives rounding to 16 bits
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_without_a_residual_leaves_the_stream_alone(native, dtype):
    h, weight = random((3, 40), dtype, 3), random((40,), dtype, 4)
    before = h.clone()
    got_h, got = DecoderGlue(native).residual_norm(h, None, weight, 1e-6)
    assert torch.equal(got_h, before) and torch.equal(h, before)
    torch.testing.assert_close(got.float(), rms_norm(before, weight, 1e-6).float(), rtol=2 * ULP[dtype], atol=1e-6)


def rotary_case(dtype, rows, heads, head_dim):
    config = type("Config", (), dict(head_dim=head_dim, rope_theta=10000.0, rope_scaling=None))()
    rotary = RotaryEmbedding(config, 64, torch.device("cpu"))
    positions = torch.randint(0, 64, (rows,), generator=torch.Generator().manual_seed(5))
    return random((rows, heads, head_dim), dtype, 6), *rotary.tables(positions, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,head_dim", [(1, 1, 2), (3, 5, 18), (17, 12, 64)])
def test_rotation_has_the_bits_of_the_torch_chain(native, dtype, rows, heads, head_dim):
    x, cos, sin_signed = rotary_case(dtype, rows, heads, head_dim)
    want = RotaryEmbedding.apply(x, cos, sin_signed)
    got = DecoderGlue(native).rotate(x, cos, sin_signed)
    assert got.data_ptr() == x.data_ptr() and torch.equal(got, want)


def test_rotation_of_a_strided_view_touches_only_its_heads(native):
    # the q and k heads of a fused qkv product: rows hold 4 + 2 heads, the first 4 are rotated
    qkv, cos, sin_signed = rotary_case(torch.bfloat16, 9, 6, 32)
    want = torch.cat([RotaryEmbedding.apply(qkv[:, :4], cos, sin_signed), qkv[:, 4:]], dim=1)
    DecoderGlue(native).rotate(qkv[:, :4], cos, sin_signed)
    assert torch.equal(qkv, want)


def test_the_torch_path_returns_new_tensors():
    h, delta, weight = random((2, 8), torch.float32, 7), random((2, 8), torch.float32, 8), random((8,), torch.float32, 9)
    before = h.clone()
    glue = DecoderGlue(None)
    got_h, got = glue.residual_norm(h, delta, weight, 1e-6)
    assert torch.equal(h, before) and torch.equal(got_h, before + delta)
    assert torch.equal(got, rms_norm(before + delta, weight, 1e-6))
    x, cos, sin_signed = rotary_case(torch.float32, 2, 3, 8)
    x_before = x.clone()
    assert torch.equal(glue.rotate(x, cos, sin_signed), RotaryEmbedding.apply(x_before, cos, sin_signed))
    assert torch.equal(x, x_before)


def test_the_native_pass_refuses_what_it_cannot_read(native):
    h = torch.ones(2, 8)
    with pytest.raises(RuntimeError, match=r"h \[N, D\] and weight \[D\]"):
        native.residual_rms_norm(h, None, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="delta must have h's shape"):
        native.residual_rms_norm(h, torch.ones(1, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.residual_rms_norm(h, None, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="whole heads"):
        native.rotate_heads(torch.ones(2, 8, 4).transpose(1, 2), torch.ones(2, 8), torch.ones(2, 8))
    with pytest.raises(RuntimeError, match=r"cos and sin_signed \[N, Dh\]"):
        native.rotate_heads(torch.ones(2, 3, 8), torch.ones(2, 4), torch.ones(2, 4))


def silu_native(native):
    if not hasattr(native, "silu_mul"):
        pytest.skip("this host's build has no native silu_mul (AVX-512 BW/VL and AVX2 builds only); torch's operators run instead")
    return native


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1), (1, 8192), (3, 37), (70, 96)])
def test_silu_mul_is_torchs_up_to_the_exponential(native, dtype, rows, width):
    gate_up = random((rows, 2 * width), dtype, 7) * 4  # gates well into both tails
    gate_up[0, 0] = 0.0
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = DecoderGlue(silu_native(native)).silu_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == dtype and got[0, 0] == 0
    # exp within ~1e-7 of Sleef's: silu's float32 value a few steps from torch's, so a 16-bit rounding of it
    # rarely lands on the other neighbour (one unit of silu, then at most one more in the product)
    torch.testing.assert_close(got.float(), want.float(), rtol=max(3 * ULP[dtype], 1e-6), atol=1e-6)
    if dtype != torch.float32:
        assert (got == want).float().mean() > 0.99


def test_silu_mul_rounds_silu_before_the_product(native):
    # gates where rounding silu to bf16 before multiplying by 3 gives another bf16 than rounding once at the end
    gates = torch.tensor([-5.90625, -5.78125, -5.625], dtype=torch.bfloat16)
    gate_up = torch.cat([gates, torch.full((3,), 3.0, dtype=torch.bfloat16)]).view(1, 6)
    twice = torch.nn.functional.silu(gates) * 3.0
    once = (torch.nn.functional.silu(gates.float()) * 3.0).bfloat16()
    assert not torch.equal(twice, once)  # the cases tell the two apart
    assert torch.equal(DecoderGlue(silu_native(native)).silu_mul(gate_up)[0], twice)


def test_silu_mul_without_the_native_pass_is_torchs_two_operators():
    gate_up = random((2, 10), torch.bfloat16, 8)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(DecoderGlue(None).silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


def test_silu_mul_refuses_what_it_cannot_read(native):
    silu_native(native)
    with pytest.raises(RuntimeError, match=r"contiguous CPU \[N, 2F\]"):
        native.silu_mul(torch.ones(2, 7))
    with pytest.raises(RuntimeError, match=r"contiguous CPU \[N, 2F\]"):
        native.silu_mul(torch.ones(8, 2).t())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        native.silu_mul(torch.ones(1, 4, dtype=torch.float64))
