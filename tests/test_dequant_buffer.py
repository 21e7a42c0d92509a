"""The int8 prefill product dequantizes into one reused per-thread buffer (services/kernels/dequant_buffer.py)."""

import threading

import torch

from services.kernels.dequant_buffer import DequantBuffer
from services.kernels.linear_candidates import candidates
from services.quantized_weight import Int8Weight


def test_the_buffer_is_reused_and_grows_only_when_needed():
    buffer = DequantBuffer()
    big, small = torch.arange(12, dtype=torch.int8).view(3, 4), torch.arange(6, dtype=torch.int8).view(2, 3) - 3
    first = buffer.holding(big, torch.bfloat16)
    assert first.tolist() == big.float().tolist() and first.dtype == torch.bfloat16
    second = buffer.holding(small, torch.bfloat16)
    assert second.tolist() == small.float().tolist()
    assert second.data_ptr() == first.data_ptr()  # the same storage, not a new allocation
    grown = buffer.holding(torch.ones(5, 4, dtype=torch.int8), torch.bfloat16)
    assert grown.shape == (5, 4) and grown.data_ptr() != first.data_ptr()
    assert buffer.holding(small, torch.float32).dtype == torch.float32  # one buffer per dtype


def test_each_thread_has_its_own_buffer():
    buffer, held = DequantBuffer(), []  # the tensors are kept: a freed buffer's address could be reused
    weight = torch.ones(4, 4, dtype=torch.int8)

    def convert() -> None:
        held.append(buffer.holding(weight, torch.bfloat16))

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({t.data_ptr() for t in held}) == 2


def test_dequantizing_product_is_right_for_weights_of_every_shape_in_turn():
    """Results of differently shaped weights, called in turn (larger, smaller, larger again), are each
    their own weight's, with and without a bias."""
    g = torch.Generator().manual_seed(7)
    fn = candidates("int8", True, 48, 1 << 62, None)["dequant.linear"]
    shapes = [(64, 48), (16, 48), (64, 48), (24, 48)]
    weights = [Int8Weight.quantize(torch.randn(shape, generator=g)) for shape in shapes]
    x = torch.randn(70, 48, generator=g).bfloat16()
    bias = torch.randn(16, generator=g).bfloat16()
    for _ in range(2):
        for weight in weights:
            want = (x.float() @ weight.qweight.float().T).bfloat16().float() * weight.scale
            got = fn(x, weight, None).float()
            assert (got - want).abs().max() <= 0.01 * want.abs().max()
        with_bias = fn(x, weights[1], bias).float()
        assert (with_bias - fn(x, weights[1], None).float() - bias.float()).abs().max() <= 0.02 * with_bias.abs().max()


def test_a_buffer_made_under_inference_mode_is_not_reused_outside_it():
    buffer, weight = DequantBuffer(), torch.ones(4, 4, dtype=torch.int8)
    with torch.inference_mode():
        inside = buffer.holding(weight, torch.bfloat16)
    outside = buffer.holding(weight * 2, torch.bfloat16)  # writing into `inside` here would raise
    assert not outside.is_inference() and outside.tolist() == (weight * 2).float().tolist()
    with torch.inference_mode():
        assert buffer.holding(weight, torch.bfloat16).data_ptr() == inside.data_ptr()
