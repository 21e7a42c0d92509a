"""The 4-bit product benchmark times every candidate the plan has for int4 and w4a8 weights and writes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.kernels import native as native_build
from services.kernels.linear_candidates import candidates


def test_every_candidate_is_timed_and_written(native):
    out = subprocess.run([sys.executable, "-m", "benchmarks.four_bit_products", "--threads", "1", "--shapes", "qkv",
                          "--rows", "1", "3", "--rounds", "1", "--dtype", "float32"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]).stdout
    results = json.loads(Path(out.strip().splitlines()[-1].removeprefix("wrote ")).read_text())
    assert results["environment"]["x"] == "float32" and results["environment"]["march"] == native_build.cflags()[1]
    for rows in (1, 3):
        want = {f"{fmt} {name}" for fmt in ("int4", "w4a8")
                for name in candidates(fmt, True, 2048, rows, native, compute=torch.float32)}
        got = [r for r in results["results"] if r["rows"] == rows]
        assert {r["kernel"] for r in got} == want and all(r["shape"] == "qkv" and r["ms"] > 0 for r in got)
        assert all(r["mac_per_ns"] == pytest.approx(rows * 3072 * 2048 / r["ms"] / 1e6) for r in got)
    assert "qkv 3072x2048" in out

