"""Shared fixtures: the trained checkpoint in ../shared (skipped when absent), small model folders and the
native kernels' build (skipped where this host cannot compile it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Every engine of the suite (in-process, Ray workers, server subprocesses: they inherit it) runs the
# native kernels wherever they can: engines compared token by token must not choose kernels apart by
# timing a busy host. tests/test_kernel_plan.py tests the measured choice itself.
os.environ.setdefault("PDSERVE_KERNELS", "native")

# ../shared beside the checkout; PDSERVE_SHARED points elsewhere (benchmarks/gpu_check.sh carries a copy).
SHARED = Path(os.environ.get("PDSERVE_SHARED") or Path(__file__).resolve().parents[2] / "shared")
STORIES = SHARED / "models" / "stories260K"


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models/stories260K absent (a user's clone lacks ../shared)")
    return STORIES


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> Path:
    from services.model_presets import write_model

    return write_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def native():
    from services.kernels.native import load

    module = load()
    if module is None:
        pytest.skip("this host cannot compile the native kernels (the engine falls back to torch's)")
    return module
