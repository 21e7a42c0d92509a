"""Typed, validated fields of a checkpoint's JSON files: every bad value is a `CheckpointError`
naming the file, the field and the value (imports no torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.errors import CheckpointError


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc


_MISSING: Any = object()


def positive_int(raw: dict, key: str, source: str, default: Any = _MISSING) -> int:
    value = _present(raw, key, source, default)
    # bool is an int subclass; JSON `true` is never a valid size
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def positive_float(raw: dict, key: str, source: str, default: Any = _MISSING) -> float:
    value = _present(raw, key, source, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CheckpointError(f"{source}: field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _present(raw: dict, key: str, source: str, default: Any) -> Any:
    """raw[key], or `default` where it is absent or null; absent without a default is an error."""
    value = raw.get(key)
    if value is not None:
        return value
    if default is _MISSING:
        raise CheckpointError(f"{source}: required field {key!r} is missing")
    return default


def flag(raw: dict, key: str, source: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: field {key!r} must be true or false, got {value!r}")
    return value


def token_ids(value: Any, key: str, vocab: int, source: str) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
            raise CheckpointError(f"{source}: field {key!r} holds {token_id!r}, not a token id below {vocab}")
    return tuple(dict.fromkeys(ids))  # drop duplicates, keep order
