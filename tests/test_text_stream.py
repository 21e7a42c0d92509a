"""TextStream: a stop string completed by one token of a merged delta ends the count there."""

from __future__ import annotations

import pytest

from services.sampling_params import SamplingParams
from services.text_stream import TextStream
from services.tokenizer import Tokenizer

TEXT = "the quick brown fox jumps over the lazy dog and runs far away"


@pytest.fixture(scope="module")
def tokenizer(tiny_path) -> Tokenizer:
    return Tokenizer.from_folder(tiny_path)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_merged_deltas_count_only_the_tokens_up_to_the_stop(tokenizer, chunk):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=("lazy",))
    needed = next(k for k in range(1, len(ids) + 1) if "lazy" in tokenizer.decode(ids[:k]))
    stream, used = TextStream(tokenizer, [], params), 0
    for start in range(0, len(ids), chunk):
        stream.feed(ids[start : start + chunk], start + chunk >= len(ids))
        used += stream.consumed
    assert stream.stopped and stream.text == TEXT[: TEXT.index("lazy")]
    assert used == needed < len(ids)


def test_without_stop_strings_every_token_counts(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stream = TextStream(tokenizer, [], SamplingParams())
    assert stream.feed(ids, True) == TEXT and stream.consumed == len(ids)
