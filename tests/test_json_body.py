"""router/json_body.py: the same values and errors as json.loads, in short C calls for long id arrays."""

import json
import random

import pytest

from router import json_body

RNG = random.Random(0)
IDS = [RNG.randrange(50_000) for _ in range(120_000)]  # ~700 KB of JSON


def both(text: str):
    results = []
    for loads in (json.loads, json_body.loads):
        try:
            results.append(loads(text))
        except json.JSONDecodeError as error:
            results.append((error.msg, error.pos))
    return results


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": IDS, "max_tokens": 4},
    {"prompt": [IDS[:60_000], IDS[60_000:], [1, 2]], "stop": ["[", "]"], "n": 2},
    {"prompt": IDS, "messages": [{"role": "user", "content": "a \\ b \" [1,2]"}]},
    {"prompt": "text [" + "1," * 150_000 + "1]"},  # an array inside a string stays a string
    {"a": [1.5, -2, 1e300, True, None] * 30_000},
    {"prompt": [IDS, IDS]},
])
def test_same_values_as_json_loads(body):
    text = json.dumps(body)
    expected, got = both(text)
    assert got == expected
    assert json_body.loads(text.encode()) == expected


@pytest.mark.parametrize("text", [
    '{"prompt": [' + "1," * 200_000 + "]}",  # trailing comma
    '{"prompt": [' + "1,," * 100_000 + "1]}",
    '{"prompt": [' + "1," * 200_000 + "01]}",
    '{"prompt": [' + "1," * 200_000 + '1], "x": }',
    '{"p": "\\\\", "prompt": [' + "1," * 200_000 + "x]}",
])
def test_same_errors_as_json_loads(text):
    expected, got = both(text)
    assert isinstance(expected, tuple)
    assert got == expected


def test_long_arrays_are_parsed_in_short_calls(monkeypatch):
    """The GIL is held per json.loads call: none of them may see more than a slice (plus the short rest)."""
    sizes = []
    real = json.loads

    def recording(text, *args, **kwargs):
        sizes.append(len(text))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(json_body.json, "loads", recording)
    body = json.dumps({"model": "m", "prompt": IDS * 8, "max_tokens": 4})  # ~5.6 MB
    assert json_body.loads(body) == real(body)
    assert len(sizes) > len(body) // json_body.SLICE_CHARS  # every character parsed once
    assert sum(sizes) < len(body) + 64 * len(sizes)
    assert max(sizes) < json_body.SLICE_CHARS + 16
