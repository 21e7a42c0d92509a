"""Where pdserve keeps what it makes once per host: generated models, compiled kernels, kernel choices."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PDSERVE_CACHE`, else ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")
