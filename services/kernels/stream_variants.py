"""How the streaming decode kernels may read W, by candidate name: skinny_linear's variants, and the parts and
prefetch locality of the kernels that read W row by row (the x16 kernels, w8a8's rows)."""

from __future__ import annotations

# skinny_linear's variants by candidate name: (W rows in flight per thread, non_temporal prefetch, the rows one
# from each quarter of the rows a thread takes at a time); the read ceilings time them too (services/hardware_peaks.py,
# benchmarks/ceilings.py)
SKINNY_VARIANTS = {"native": (1, False, False), "native.4rows": (4, False, False), "native.4rows.nt": (4, True, False),
                   "native.4parts": (4, False, True), "native.4parts.nt": (4, True, True)}
# The row-by-row kernels (x16_groups.h's, int4_linear, w8a8_row_linear): each thread's W rows also read as this many
# parts, a row of each together for one x row, in turn for several (more of W in flight where the kernel waits on
# memory; where it waits on its arithmetic, one part wins). Together, on a Zen 2: a whole int8 `1b` decode step
# 47.7 -> 39.8 ms, int4 36.5 -> 34.0
X16_STREAMS = 4
# (streams, non_temporal): each as one part or X16_STREAMS, W prefetched into the caches or past them (a whole
# int8 / int4 `1b` decode step 9% faster past them on a Zen 2: 56.5 -> 51.3 ms, 38.5 -> 35.1 ms)
X16_VARIANTS = ((1, False), (X16_STREAMS, False), (1, True), (X16_STREAMS, True))
# int4_panel_linear's, for one x row: its panels as 1, 2 or 4 parts (2 or 4 parts the fastest by turns, 1 slower:
# AMD EPYC Zen 4, 2 threads, the `1b` shapes from memory), prefetched into the caches or past them; for several rows
# the parts change nothing
PANEL_VARIANTS = tuple((streams, nt) for nt in (False, True) for streams in (1, 2, 4))


def parts_name(kernel: str, streams: int, non_temporal: bool) -> str:
    """The candidate name of `kernel` reading W as `streams` parts, prefetched past the caches or not."""
    return kernel + (f".{streams}streams" if streams > 1 else "") + (".nt" if non_temporal else "")
