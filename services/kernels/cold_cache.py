"""Timing a decode kernel as the engine runs it: with its weight out of the CPU's caches.

A decode step reads every weight once, and a model larger than the last-level cache reads each one
after all the others: from memory. Timed alone and repeated, a weight of up to the cache's size is read
from the cache instead, and the kernel that wins there (the one with the least arithmetic) need not win
from memory (the one that keeps the most of W in flight): a 16384 x 2048 int8 product ran at 44 GB/s
repeated against 23 GB/s in a cycle of 16 distinct weights (AMD EPYC Zen 3, 32 MiB L3; docs/kernels.md).
So before each timed call of a few-row product the kernel plan reads the model's other weights, as a step does, and
flushes the weight's own bytes out of every cache level (the native `flush_cache_lines`, clflushopt). What it did
first, reading a buffer twice the cache's size, evicted too little on a large adaptive L3: an Intel Xeon with 300 MB
(family 6 model 207) kept much of a 16384 x 2048 int8 weight timed 7 times between reads of 600 MB, so a 4-stream
kernel read it at 40 GB/s against a 32 GB/s read ceiling, won, and was 13% slower in the decode step than the
kernel the flushed timing picks (the int8 `1b` step 45.8 against 40.5 ms, alternated).

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

from services.kernels.bf16_panels import BF16_PANELS
from services.kernels.int4_panels import INT4_PANELS
from services.kernels.int8_panels import INT8_PANELS

DEFAULT_LLC_BYTES = 32 << 20  # where sysfs does not say (not Linux)
HOT_BYTES = 2 << 20  # what a decode step's other operators read between two products (see above)
# the other weights read before each timed call, in last-level caches' worth (the weight timed is flushed): they push
# out a kernel's own copy of it (oneDNN's packed one, which no flush can reach) and what else it left in the caches
SWEEP_CACHES = 2
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
    """`evict(weight)` reads the model's other weights, SWEEP_CACHES times the last-level cache's size of them (or all,
    where they are fewer) from where the last sweep stopped — as a decode step reads them between two uses of one
    weight; a kernel's own copies of its weight (oneDNN's packed one) go out with them — then flushes the weight's own
    bytes (and its int4 panel copy's, int4_panels.py) out of every cache level where `flush` (the native
    `flush_cache_lines`) is given, then reads the hot set;
    `reread()` reads the hot set again (timed with the kernel)."""

    def __init__(self, cache_bytes: int, weights: list, flush: Callable[[torch.Tensor], None] | None = None) -> None:
        self.sweep = unique_tensors(weights)
        self.budget = SWEEP_CACHES * cache_bytes
        self.flush = flush
        self.hot = torch.ones(HOT_BYTES // 4)
        self._next = 0  # where the next sweep starts

    @classmethod
    def for_weights(cls, weights: list, device: torch.device,
                    flush: Callable[[torch.Tensor], None] | None = None) -> ColdCache | None:
        """None where the engine's weights fit in the cache (a tiny model reads them from it) or off the CPU."""
        cache_bytes = last_level_cache_bytes()
        if device.type != "cpu" or sum(t.nbytes for t in unique_tensors(weights)) <= cache_bytes:
            return None
        return cls(cache_bytes, weights, flush)

    def evict(self, weight: object) -> None:
        own = {t.data_ptr() for t in weight_tensors(weight)}
        swept = 0
        for _ in range(len(self.sweep)):
            tensor = self.sweep[self._next]
            self._next = (self._next + 1) % len(self.sweep)
            if tensor.data_ptr() not in own:
                read(tensor)
                swept += tensor.nbytes
                if swept >= self.budget:
                    break
        if self.flush is not None:  # and a weight's panel copy: on a large adaptive L3 the sweep leaves some
            for tensor in [*weight_tensors(weight), *INT4_PANELS.held(weight), *INT8_PANELS.held(weight),
                           *BF16_PANELS.held(weight)]:
                self.flush(tensor)
        self.hot.sum()

    def reread(self) -> None:
        self.hot.sum()


def read(tensor: torch.Tensor) -> None:
    """Every byte of a contiguous tensor read once, at the read ceiling's pace: as float32 where its bytes allow (torch
    sums int8 at ~0.5 GB/s, float32 at ~28)."""
    raw = tensor.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 4 * 4
    (raw[:whole].view(torch.float32) if raw.data_ptr() % 4 == 0 else raw).sum()


def unique_tensors(weights: list) -> list[torch.Tensor]:
    """Every tensor of `weights` once (a tied weight, or one listed twice, counts once)."""
    return list({t.data_ptr(): t for w in weights for t in weight_tensors(w)}.values())


def weight_tensors(weight: object) -> list[torch.Tensor]:
    """The tensors a product reads of `weight`: itself, or a quantized weight's fields (values, scales, offsets)."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [v for f in dataclasses.fields(weight) if isinstance(v := getattr(weight, f.name), torch.Tensor)]
