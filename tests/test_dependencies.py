"""Dependency direction (STYLE.md rule 12): the router and the engine's bookkeeping import no torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE_SERVICES = ["sequence", "block_manager", "scheduler", "protocol", "kv_payload", "sampling_params", "model_config",
                       "engine_config", "tokenizer", "detokenizer", "stop_checker", "text_stream", "request_output", "errors",
                       "gguf_file", "gguf_tokenizer", "gguf_folder", "default_model", "batch_buckets", "kv_transport_choice"]  # the router resolves --model with them


def router_modules() -> list[str]:
    return [f"router.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "router")])]


@pytest.mark.parametrize("module", ["services"] + [f"services.{m}" for m in TORCH_FREE_SERVICES] + router_modules())
def test_module_imports_no_torch(module):
    code = f"import sys, {module}; sys.exit(3 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"{module} imports torch (or failed): {result.stderr[-500:]}"


def test_router_has_no_lazy_torch_import():
    for path in (ROOT / "router").glob("*.py"):
        text = path.read_text()
        for forbidden in ("import torch", "from torch"):
            assert forbidden not in text, f"{path.name} contains {forbidden!r}"
