"""Parsers of `pdserve` flag values: each returns the value or raises argparse's error naming the rule."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {text}")
    return value


def local_prefill(text: str) -> int | None:
    return None if text == "auto" else non_negative_int(text)


def gpu_share(text: str) -> float | None:
    if text == "auto":
        return None
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be auto or a number in [0, 1] (one engine uses one GPU), got {text}")
    return value


def labels(text: str) -> dict[str, str]:
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    if not pairs or any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        raise argparse.ArgumentTypeError(f"labels must look like key=value[,key=value], got {text!r}")
    return dict(pairs)
