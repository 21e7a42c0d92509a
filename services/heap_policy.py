"""How a CPU worker's C library hands out large blocks: from its heap, kept for reuse once freed.

Why: glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mapping and unmaps it on
free, so each layer of a prefill met its large activations as new pages (1,024 rows of the `1b` preset: the gate_up
output alone is 32 MB) and faulted every 4 KB of them in again: `perf` put ~7% of a 1,024-token prefill in the
kernel's fault handling and page clearing. With large blocks taken from the heap and the heap not trimmed, a layer
reuses the pages the ones before it freed: 1,024-token prefills of `1b` took a median 1.08 / 1.17 s against 1.31 /
1.26 s (two alternated pairs of 5), and a mixed run of 40 requests 38.6 s against 43.7 s (Intel Xeon, family 6 model
207, 2 threads). The cost: freed memory stays with the process, reused for later blocks — that run ended 165 MB larger
(8.55 GB resident against 8.38) — except what is free once an engine is built, handed back then.
`PDSERVE_KEEP_FREED_MEMORY=0` keeps glibc's defaults; elsewhere than glibc (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

ENV = "PDSERVE_KEEP_FREED_MEMORY"
# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest free top of the heap kept (2 GB)

_applied: bool | None = None  # once per process
_LIBC = ctypes.CDLL(None)  # the process's own C library (glibc: mallopt, malloc_trim)


def keep_freed_memory() -> bool:
    """Large blocks from the heap (no mmap), the heap not trimmed below 2 GB of free top; whether that holds now.
    Each call (each engine, once built) also hands back what is free at that moment: a later engine's construction
    in the same process — its quantization's and kernel plan's temporaries — would otherwise stay with the process
    (three `1b` engines, bf16, int8 and w8a8, in one process: 18.1 GB resident against 13.6 without the policy)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    if _applied:
        _LIBC.malloc_trim(0)  # every free page back, in the heap's middle too (madvise)
    return _applied


def _apply() -> bool:
    setting = os.environ.get(ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {setting!r}")
    if setting == "0":
        return False
    if not hasattr(_LIBC, "gnu_get_libc_version") or not hasattr(_LIBC, "mallopt"):
        log.info("the C library is not glibc: its handling of large blocks is left as it is")
        return False
    # mallopt returns 1 on success; both or neither (a half-applied policy would only trim less)
    if _LIBC.mallopt(M_MMAP_MAX, 0) != 1 or _LIBC.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) != 1:
        log.warning("glibc refused mallopt: large blocks stay mapped and unmapped per allocation")
        return False
    return True
