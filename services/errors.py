"""Typed errors that cross module boundaries (mapped to clear messages at the CLI and HTTP edges)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A model folder is missing a file, has a truncated or mismatched file, or an unsupported value."""


class KVTransferError(RuntimeError):
    """A KV hand-off payload failed validation (shape, dtype or checksum)."""
