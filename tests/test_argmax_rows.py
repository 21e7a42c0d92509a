"""The native greedy argmax (kernels/argmax_rows.cpp) gives torch.argmax's indices: ties, NaN, -inf, every tail."""

from __future__ import annotations

import math

import pytest
import torch

from services.sampler import greedy_tokens


@pytest.mark.parametrize("vocab", [1, 5, 15, 16, 17, 31, 32, 33, 100, 32000, 65537])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_argmax_rows_matches_torch_on_random_logits(native, rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab * 100 + rows))
    assert torch.equal(native.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [7, 16, 40, 1000])
def test_ties_take_the_first_index_in_every_lane_and_tail(native, vocab):
    # the maximum at several places: at each lane of the 16-wide pass, in the tail, and -0.0 against 0.0
    for places in ([0, vocab - 1], [vocab - 1], [3, 19, 35], [vocab // 2, vocab // 2 + 16, vocab - 1], [5, 6]):
        places = [p for p in places if p < vocab]
        row = torch.full((1, vocab), -1.0)
        row[0, places] = 2.5
        assert native.argmax_rows(row).tolist() == [min(places)] == row.argmax(dim=-1).tolist()
    zeros = torch.full((1, vocab), -1.0)
    zeros[0, vocab - 1] = 0.0
    zeros[0, vocab // 2] = -0.0
    assert native.argmax_rows(zeros).tolist() == zeros.argmax(dim=-1).tolist() == [vocab // 2]


@pytest.mark.parametrize("vocab", [9, 16, 50, 4099])
def test_nan_wins_at_its_first_index_and_minus_inf_rows_give_zero(native, vocab):
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[0, vocab - 1] = math.nan
    logits[1, [vocab // 3, vocab - 2]] = math.nan
    logits[2] = -math.inf
    logits[3, 0] = math.inf
    logits[3, vocab - 1] = math.inf
    got = native.argmax_rows(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got.tolist() == [vocab - 1, vocab // 3, 0, 0]


def test_argmax_rows_refuses_what_it_cannot_read(native):
    with pytest.raises(RuntimeError, match="float32"):
        native.argmax_rows(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        native.argmax_rows(torch.randn(8, 2).t())
    with pytest.raises(RuntimeError, match="vocab"):
        native.argmax_rows(torch.randn(2, 0))


def test_greedy_tokens_uses_the_kernel_only_where_it_applies(native):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1)
    assert torch.equal(greedy_tokens(logits, native), expected)
    assert torch.equal(greedy_tokens(logits, None), expected)
    strided = torch.randn(300, 6, generator=torch.Generator().manual_seed(2)).t()  # not contiguous: torch's
    assert torch.equal(greedy_tokens(strided, native), strided.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits.double(), native), expected)
