"""How a benchmark reports: the environment it ran in, a plain-text table, and its JSON file."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from services.kernels.native import cpu_model

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    """What every figure must be stated with: CPU, thread count, library versions."""
    return {
        "cpu": cpu_model(),
        "num_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def format_table(header: list[str], rows: list[list]) -> str:
    """Left-aligned first column, right-aligned others; floats with 3 significant digits (or whole, from 100)."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    table = [header] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for j, row in enumerate(table):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_results(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
