"""Timing a decode kernel as the engine runs it: with its weight out of the CPU's caches.

A decode step reads every weight once, and a model larger than the last-level cache reads each one
after all the others: from memory. Timed alone and repeated, a weight of up to the cache's size is read
from the cache instead, and the kernel that wins there (the one with the least arithmetic) need not win
from memory (the one that keeps the most of W in flight): a 16384 x 2048 int8 product ran at 44 GB/s
repeated against 23 GB/s in a cycle of 16 distinct weights (AMD EPYC Zen 3, 32 MiB L3; docs/kernels.md).
So the kernel plan reads a buffer twice the cache's size before each timed call of a few-row product.

A product also evicts: between two products a decode step's other operators (norms, attention, the
interpreter) read their own data again, and whatever the product's stream pushed out of the caches comes
back from memory. So each timed call is also charged for re-reading a hot set of HOT_BYTES, read just before
it: a kernel whose stream bypasses the caches (a non-temporal prefetch) keeps that set, and wins where the
engine would see it win. Measured on an AMD EPYC Zen 2, bf16 `1b` decode: with the products' arithmetic
skipped the rest of a step took ~3 ms, beside them ~7.8 ms, ~74 us more after each of the 65 products —
about what re-reading 2 MB from memory costs there; timed alone, the non-temporal kernel lost on two of the
five weights, and in the step it won on all five (91.6 against 95.0 ms).
"""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_LLC_BYTES = 32 << 20  # where sysfs does not say (not Linux)
HOT_BYTES = 2 << 20  # what a decode step's other operators read between two products (see above)
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs writes "32768K"


def last_level_cache_bytes(cpu_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the largest data cache of CPU 0, from sysfs ("32768K"), else DEFAULT_LLC_BYTES."""
    sizes = []
    for index in cpu_dir.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        number, unit = (text[:-1], SIZE_UNITS[text[-1]]) if text and text[-1] in SIZE_UNITS else (text, 1)
        if number.isdigit():
            sizes.append(int(number) * unit)
    return max(sizes, default=DEFAULT_LLC_BYTES)


class ColdCache:
    """`evict()` reads a float32 buffer twice the last-level cache's size, pushing out what a kernel read, then
    reads the hot set; `reread()` reads the hot set again (timed with the kernel)."""

    def __init__(self, cache_bytes: int) -> None:
        self.buffer = torch.ones(2 * cache_bytes // 4)  # filled: every page mapped
        self.hot = torch.ones(HOT_BYTES // 4)

    @classmethod
    def for_weights(cls, total_weight_bytes: int, device: torch.device) -> ColdCache | None:
        """None where the engine's weights fit in the cache (a tiny model reads them from it) or off the CPU."""
        cache_bytes = last_level_cache_bytes()
        if device.type != "cpu" or total_weight_bytes <= cache_bytes:
            return None
        return cls(cache_bytes)

    def evict(self) -> None:
        self.buffer.sum()
        self.hot.sum()

    def reread(self) -> None:
        self.hot.sum()
