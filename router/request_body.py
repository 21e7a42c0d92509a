"""A request's JSON body read into its pydantic model, answering 400 (never 422) when it does not fit.

The routes parse their bodies here, on the router's CPU threads (`cpu_pool.py`), instead of letting
FastAPI parse them on the event loop; `openapi.py` documents the bodies from the same models."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from router import json_body
from router.errors import invalid_body, not_json

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: bytes) -> M:
    try:
        data = json_body.loads(raw)  # as FastAPI parses (NaN and Infinity pass; the models refuse them)
    except json.JSONDecodeError as error:
        raise not_json(error.pos) from None
    except (UnicodeDecodeError, RecursionError):  # not UTF-8; nested deeper than Python recurses
        raise not_json(None) from None
    try:
        # Strict: a field is of its documented JSON type ("n": "2" and "echo": 1 are refused, as
        # the OpenAPI document says), not whatever pydantic could coerce into it.
        return model.model_validate(data, strict=True)
    except ValidationError as error:
        raise invalid_body(error.errors(include_url=False)) from None
