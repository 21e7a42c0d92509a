"""A JSON response written in pieces, so that a large one does not hold the GIL for its whole
rendering: one `json.dumps` call keeps it from the event loop until it returns (about 0.1 s for the
4 MB answer of a 60,000-token prompt scored with echo and logprobs); between pieces the loop gets it.
The bytes are those of Starlette's `JSONResponse`."""

from __future__ import annotations

import functools
import json

from starlette.responses import Response

PIECE = 512  # list items per json.dumps call: ~1 ms of rendering for top-5 logprob entries

_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class PiecewiseJSONResponse(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        parts: list[str] = []
        _write(content, parts)
        return "".join(parts).encode("utf-8")


def _write(value, parts: list[str]) -> None:
    if isinstance(value, dict):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            parts.append("," if i else "")
            parts.append(_dumps({key: None})[1:-6])  # the key as json.dumps writes it (int keys too)
            parts.append(":")
            _write(item, parts)
        parts.append("}")
    elif isinstance(value, list) and len(value) > PIECE:
        pieces = (_dumps(value[i:i + PIECE])[1:-1] for i in range(0, len(value), PIECE))
        parts.append("[" + ",".join(pieces) + "]")
    elif isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        parts.append("[")
        for i, item in enumerate(value):
            parts.append("," if i else "")
            _write(item, parts)
        parts.append("]")
    else:
        parts.append(_dumps(value))
