"""Timing a decode kernel as the engine runs it: with its weight out of the CPU's caches.

A decode step reads every weight once, and a model larger than the last-level cache reads each one
after all the others: from memory. Timed alone and repeated, a weight of up to the cache's size is read
from the cache instead, and the kernel that wins there (the one with the least arithmetic) need not win
from memory (the one that keeps the most of W in flight): a 16384 x 2048 int8 product ran at 44 GB/s
repeated against 23 GB/s in a cycle of 16 distinct weights (AMD EPYC Zen 3, 32 MiB L3; docs/kernels.md).
So before each timed call of a few-row product the kernel plan flushes the weight's bytes out of every cache
level (the native `flush_cache_lines`, clflushopt). Reading a buffer twice the cache's size instead, what the plan
did first and still does where the native build is missing, evicts too little on a large adaptive L3: an Intel Xeon
with 300 MB (family 6 model 207) kept much of a 16384 x 2048 int8 weight timed 7 times between reads of 600 MB, so
a 4-stream kernel read it at 40 GB/s against a 32 GB/s read ceiling, won, and was 13% slower in the decode step
than the kernel the flushed timing picks (int8 `1b` step 45.8 against 40.5 ms, alternated).

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

import dataclasses
from collections.abc import Callable
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
    """`evict(weight)` pushes the weight's bytes out of the caches — flushed where `flush` (the native
    `flush_cache_lines`) is given, else by reading a float32 buffer twice the last-level cache's size — then reads
    the hot set; `reread()` reads the hot set again (timed with the kernel)."""

    def __init__(self, cache_bytes: int, flush: Callable[[torch.Tensor], None] | None = None) -> None:
        self.flush = flush
        self.buffer = None if flush else torch.ones(2 * cache_bytes // 4)  # filled: every page mapped
        self.hot = torch.ones(HOT_BYTES // 4)

    @classmethod
    def for_weights(cls, total_weight_bytes: int, device: torch.device,
                    flush: Callable[[torch.Tensor], None] | None = None) -> ColdCache | None:
        """None where the engine's weights fit in the cache (a tiny model reads them from it) or off the CPU."""
        cache_bytes = last_level_cache_bytes()
        if device.type != "cpu" or total_weight_bytes <= cache_bytes:
            return None
        return cls(cache_bytes, flush)

    def evict(self, weight: object) -> None:
        if self.flush is None:
            self.buffer.sum()
        else:
            for tensor in weight_tensors(weight):
                self.flush(tensor)
        self.hot.sum()

    def reread(self) -> None:
        self.hot.sum()


def weight_tensors(weight: object) -> list[torch.Tensor]:
    """The tensors a product reads of `weight`: itself, or a quantized weight's fields (values, scales, offsets)."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [v for f in dataclasses.fields(weight) if isinstance(v := getattr(weight, f.name), torch.Tensor)]
