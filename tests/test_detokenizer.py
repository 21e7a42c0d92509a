"""Tests for services.detokenizer: streamed text always equals the full decode of the generated ids."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from conftest import STORIES
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from services.detokenizer import IncrementalDetokenizer
from services.tokenizer import Tokenizer

SPECIALS = ["<unk>", "<s>", "</s>"]
CORPUS = ["héllo wörld 日本語 🙂 emojis", "hello world, the quick brown fox jumps over the lazy dog."]


def byte_level_hf() -> HFTokenizer:
    """GPT-2 style: ByteLevel pre-tokenizer and decoder, so tokens can split multi-byte characters."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(CORPUS * 4, trainer)
    return hf


def byte_level_bpe() -> Tokenizer:
    return Tokenizer(byte_level_hf(), bos_token="<s>", eos_token="</s>", add_bos_token=True)


def sentencepiece_bpe() -> Tokenizer:
    """Llama-2 style: "▁" for spaces, <0xNN> byte fallback, and a decoder that strips one leading space."""
    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "h", "i", "▁a", "▁h", "▁hi", "ab"]
    merges = [("▁", "a"), ("▁", "h"), ("▁h", "i"), ("a", "b")]
    hf = HFTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True))
    hf.add_special_tokens(SPECIALS)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>", add_bos_token=True)


def stream(tok: Tokenizer, ids: list[int], group_sizes: list[int], skip_special_tokens: bool = True) -> list[str]:
    """Pushes `ids` in groups; checks every intermediate text is a prefix of the final decode."""
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=skip_special_tokens)
    pieces, start = [], 0
    for size in group_sizes:
        pieces.append(detok.push(ids[start:start + size]))
        start += size
        assert not pieces[-1].endswith("\ufffd")
        assert expected.startswith(detok.text) and detok.text == "".join(pieces)
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces) == expected
    return pieces


def random_streams(tok: Tokenizer, draw_ids: Callable[[random.Random], list[int]], seed: int,
                   num_sequences: int = 300) -> None:
    rng = random.Random(seed)
    for i in range(num_sequences):
        ids = draw_ids(rng)
        skip = i % 3 != 0
        stream(tok, ids, [1] * len(ids), skip)
        groups = []
        while sum(groups) < len(ids):
            groups.append(rng.randrange(1, 6))
        stream(tok, ids, groups, skip)


def any_ids(vocab_size: int) -> Callable[[random.Random], list[int]]:
    return lambda rng: [rng.randrange(vocab_size) for _ in range(rng.randrange(0, 40))]


def test_random_sequences_byte_level() -> None:
    tok = byte_level_bpe()
    random_streams(tok, any_ids(tok.vocab_size), seed=0)


def test_random_sequences_sentencepiece() -> None:
    # Byte-fallback tokens come as whole UTF-8 characters: `decoders.ByteFallback` turns a run of byte
    # tokens that is invalid UTF-8 into one "\ufffd" per byte, retroactively changing an earlier valid
    # byte (see the class docstring), which no streaming decoder can predict.
    tok = sentencepiece_bpe()
    pieces = [i for i in range(tok.vocab_size) if i < 3 or i >= 259]

    def draw_ids(rng: random.Random) -> list[int]:
        ids: list[int] = []
        for _ in range(rng.randrange(0, 30)):
            if rng.random() < 0.6:
                ids.append(rng.choice(pieces))
            else:
                char = chr(rng.choice([rng.randrange(0, 0x80), rng.randrange(0x80, 0xD800), rng.randrange(0x10000, 0x1FAFF)]))
                ids += [3 + b for b in char.encode()]
        return ids

    random_streams(tok, draw_ids, seed=1)


def test_random_sequences_stories260k() -> None:
    if not STORIES.is_dir():
        pytest.skip("../shared/models/stories260K absent")
    tok = Tokenizer.from_folder(STORIES)
    random_streams(tok, any_ids(tok.vocab_size), seed=2, num_sequences=100)


def byte_token_id(hf: HFTokenizer, byte: int) -> int:
    """The id of a raw one-byte token: ByteLevel spells byte b as GPT-2's `bytes_to_unicode()[b]`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    unprintable = [b for b in range(256) if b not in printable]
    return hf.token_to_id(chr(byte) if byte in printable else chr(256 + unprintable.index(byte)))


def test_split_character_is_held_back() -> None:
    hf = byte_level_hf()
    tok = Tokenizer(hf)
    ids = [byte_token_id(hf, b) for b in "a🙂!".encode()]
    assert len(ids) == 6
    assert stream(tok, ids, [1] * 6) == ["a", "", "", "", "🙂", "!", ""]
    assert stream(tok, ids, [2, 2, 2]) == ["", "", "a🙂!", ""]  # "a\ufffd" is held back whole
    assert stream(tok, ids[:4], [1, 1, 1, 1]) == ["a", "", "", "", "\ufffd"]  # flush emits the broken tail


def test_sentencepiece_leading_space() -> None:
    tok = sentencepiece_bpe()
    ids = tok.encode("hi ab hi", add_special_tokens=False)
    assert tok.decode(ids) == "hi ab hi"
    assert stream(tok, ids, [1] * len(ids)) == ["hi", " a", "b", " hi", ""]


def test_special_tokens_skipped_or_kept() -> None:
    tok = sentencepiece_bpe()
    hi, eos = tok.encode("hi", add_special_tokens=False)[0], tok.eos_token_id
    assert stream(tok, [hi, eos, hi], [1, 1, 1]) == ["hi", "", " hi", ""]
    assert stream(tok, [hi, eos, hi], [1, 1, 1], skip_special_tokens=False) == ["hi", "</s>", " hi", ""]


def test_window_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = byte_level_bpe()
    ids = tok.encode("the quick brown fox jumps over the lazy dog. 日本語 🙂 " * 40, add_special_tokens=False)
    decoded_lengths: list[int] = []
    decode = tok.decode

    def spy(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        decoded_lengths.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == decode(ids)
    assert len(ids) > 400 and max(decoded_lengths) <= 6
