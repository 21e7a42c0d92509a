"""Tests for services.stop_checker: streamed output equals the non-streaming truncation, however split."""

from __future__ import annotations

import itertools
import random

import pytest

from services.stop_checker import StopChecker


def truncate(text: str, stop: tuple[str, ...], include: bool) -> tuple[str, bool]:
    """Reference: the shortest prefix of `text` that ends with a stop string (longest stop on a tie)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            return (text[:end] if include else text[:end - max(map(len, ending))]), True
    return text, False


def stream(pieces: list[str], stop: tuple[str, ...], include: bool) -> tuple[str, bool]:
    checker = StopChecker(stop, include)
    out = []
    for piece in pieces:
        emitted, stopped = checker.feed(piece)
        out.append(emitted)
        if stopped:
            assert checker.stopped and checker.flush() == ""
            return "".join(out), True
    return "".join(out) + checker.flush(), False


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("text", "stop"), [
    ("Hello world. STOP here STOP", ("STOP",)),
    ("no stop string in here", ("STOP", "xyz")),
    ("abcd", ("abcd", "bc")),  # "bc" completes first although "abcd" starts earlier
    ("xxabc", ("ab", "abc")),  # same start: the shorter one completes first
    ("xxabc", ("xabc", "bc")),  # same end: the longer one starts earlier
    ("aaab", ("aab",)),  # the held partial "aa" must slide by one
    ("ab\nUser: hi", ("\nUser:", "\n\n")),
    ("日本語🙂の", ("🙂",)),
])
def test_every_cut_point(text: str, stop: tuple[str, ...], include: bool) -> None:
    expected = truncate(text, stop, include)
    assert stream([text], stop, include) == expected
    assert stream(list(text), stop, include) == expected
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert stream([text[:i], text[i:j], text[j:]], stop, include) == expected


def test_exact_values() -> None:
    checker = StopChecker(("STOP",), include_stop_str_in_output=False)
    assert checker.feed("hello ST") == ("hello ", False)
    assert checker.feed("O") == ("", False)
    assert checker.feed("P and more") == ("", True)
    assert checker.feed("later") == ("", True)
    checker = StopChecker(("STOP",), include_stop_str_in_output=True)
    assert checker.feed("hello ST") == ("hello ", False)
    assert checker.feed("OP and more") == ("STOP", True)


def test_overlapping_candidates() -> None:
    checker = StopChecker(("abcd", "bc"), include_stop_str_in_output=True)
    assert checker.feed("xab") == ("x", False)  # "ab" could start "abcd"; "b" could start "bc"
    assert checker.feed("c") == ("abc", True)
    checker = StopChecker(("aab",))
    assert checker.feed("aaa") == ("a", False)
    assert checker.feed("ab") == ("a", True)


def test_flush_returns_held_text() -> None:
    checker = StopChecker(("</answer>",))
    assert checker.feed("42 </ans") == ("42 ", False)
    assert checker.feed("wer") == ("", False)
    assert checker.flush() == "</answer"
    assert checker.flush() == ""
    assert not checker.stopped


def test_no_stop_strings_pass_through() -> None:
    checker = StopChecker(())
    assert checker.feed("anything") == ("anything", False)
    assert checker.flush() == ""


@pytest.mark.parametrize("stop", [("",), ("ok", ""), (None,)])
def test_bad_stop_strings(stop: tuple) -> None:
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        StopChecker(stop)


def test_random_texts_and_splits() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        stop = tuple("".join(rng.choice("ab") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4)))
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 16)))
        cuts = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randrange(0, 6)))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        include = rng.random() < 0.5
        assert stream(pieces, stop, include) == truncate(text, stop, include), (text, stop, pieces)
