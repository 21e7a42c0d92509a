"""`json.loads` for request bodies that never holds the GIL for long.

`json.loads` is one C call: on a 4 MB body of 900,000 token ids it held the GIL for ~60 ms, and every
stream and `/health` probe of the router waited that long (the parse runs on a CPU thread, but a
thread holding the GIL stops the event loop as surely as the loop itself). Such a body is almost all
one or a few long arrays of numbers. Those arrays are parsed here in slices of `SLICE_CHARS`, one
short C call each, so the interpreter can hand the GIL to the loop between them; the rest of the
body, with each long array swapped for a placeholder, is parsed as usual. Whenever a body is not of
that simple shape (a backslash before an array, a quote or bracket inside one, too many arrays to
look at), it is parsed by `json.loads` whole: the same result and the same errors, only a longer hold.
"""

from __future__ import annotations

import json
import uuid

LONG_ARRAY_CHARS = 256 * 1024  # an array shorter than this is parsed with the rest of the body
SLICE_CHARS = 128 * 1024  # ~1-2 ms of json.loads per slice
MAX_ARRAYS_SCANNED = 4096  # a body of many small arrays is not worth splitting


def loads(raw: bytes | str) -> object:
    """What `json.loads(raw)` returns (and raises)."""
    text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
    if len(text) < LONG_ARRAY_CHARS:
        return json.loads(text)
    spans = _long_number_arrays(text)
    if not spans:
        return json.loads(text)
    marker = f"pdserve-array-{uuid.uuid4().hex}-"
    if marker in text:
        return json.loads(text)
    arrays: dict[str, list] = {}
    pieces, end = [], 0
    for k, (start, stop) in enumerate(spans):
        values = _parse_in_slices(text, start + 1, stop)
        if values is None:  # not plain numbers after all: json.loads says what is wrong
            return json.loads(text)
        arrays[marker + str(k)] = values
        pieces += [text[end:start], json.dumps(marker + str(k))]
        end = stop + 1
    pieces.append(text[end:])
    try:
        rest = json.loads("".join(pieces))
    except json.JSONDecodeError:  # its position would be off: json.loads says where
        return json.loads(text)
    return _put_back(rest, arrays)


def _long_number_arrays(text: str) -> list[tuple[int, int]]:
    """(index of '[', index of its ']') of each innermost array longer than LONG_ARRAY_CHARS that holds
    no string, object or array and lies outside every string; [] when the body is not that simple."""
    spans, start = [], 0
    for _ in range(MAX_ARRAYS_SCANNED):
        close = text.find("]", start)
        if close < 0:
            return spans
        open_ = text.rfind("[", start, close)
        if open_ >= 0 and close - open_ > LONG_ARRAY_CHARS:
            if text.find('"', open_, close) >= 0 or text.find("{", open_, close) >= 0:
                return []
            # Outside every string: no escape before it, and an even number of quotes.
            if text.find("\\", 0, open_) >= 0 or text.count('"', 0, open_) % 2:
                return []
            spans.append((open_, close))
        start = close + 1
    return []


def _parse_in_slices(text: str, start: int, stop: int) -> list | None:
    """The comma-separated values of text[start:stop], parsed a slice at a time; None if one is not JSON."""
    values: list = []
    while start < stop:
        cut = text.find(",", min(start + SLICE_CHARS, stop), stop)
        cut = stop if cut < 0 else cut
        try:
            values += json.loads(f"[{text[start:cut]}]")
        except json.JSONDecodeError:
            return None
        start = cut + 1
    return values


def _put_back(value: object, arrays: dict[str, list]) -> object:
    if isinstance(value, str):
        return arrays.get(value, value)
    if isinstance(value, dict):
        return {key: _put_back(item, arrays) for key, item in value.items()}
    if isinstance(value, list):
        return [_put_back(item, arrays) for item in value]
    return value
