"""router/json_response.py: a JSON answer written in pieces is byte for byte Starlette's."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from router.json_response import PIECE, PiecewiseJSONResponse


def test_the_pieces_make_starlettes_json():
    many = PIECE * 3 + 7
    content = {"id": "cmpl-1", "choices": [{"index": 0, "text": "héllo \u2028 🙂", "logprobs": {
        "tokens": [f"t{i}" for i in range(many)], "token_logprobs": [None] + [-0.5] * (many - 1),
        "top_logprobs": [None] + [{"a": -1.0, "\"b\"": -2.5e-8} for _ in range(many - 1)],
        "text_offset": list(range(many))}, "finish_reason": None}],
        "usage": {"prompt_tokens": 3, "nested": [[1, 2], [], {}, [{"x": [True, False]}]]}, "int keys": {5: "five"},
        "empty": [], "short": [{"k": 1}] * 3}
    assert PiecewiseJSONResponse(content).body == JSONResponse(content).body
    for value in ([], {}, [1] * (PIECE + 1), "x", 1.5, None):
        assert PiecewiseJSONResponse(value).body == JSONResponse(value).body
