"""The batch-1 matrix-vector path gives F.linear's result (within 16-bit rounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.model import linear


def test_one_row_bf16_matches_f_linear_and_other_shapes_are_f_linear():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(1, 64, generator=g).bfloat16()
    torch.testing.assert_close(linear(x, w, b).float(), F.linear(x.float(), w.float(), b.float()), atol=0.1, rtol=0.02)
    x4 = torch.randn(4, 64, generator=g).bfloat16()
    assert torch.equal(linear(x4, w, b), F.linear(x4, w, b))
    x32 = torch.randn(1, 64, generator=g)
    assert torch.equal(linear(x32, w.float()), F.linear(x32, w.float()))
