"""Per-channel int8 weights: exact on a hand example, bounded error, and the format on the wire of
the engine (quantized decode workers read half the bytes)."""

from __future__ import annotations

import pytest
import torch

from services.quantized_weight import Int8Weight, quantize


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
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, w8a8 or None, got 'int3'"):
        quantize(w, "int3")
