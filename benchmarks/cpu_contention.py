"""How much CPU other processes (and the hypervisor, as steal time) take while a benchmark runs.

The build machines are shared: a neighbour's test run on the same two cores slows every parallel
torch op by a scheduler time slice. Benchmarks measure this per sample and retake samples that ran
under contention, and wait for a quiet moment before each phase.
"""

from __future__ import annotations

import os
import time

_HZ = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds spent not idle, summed over all CPUs, since boot (user nice system irq softirq steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _HZ


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """`with CpuMeter() as m: ...` then `m.foreign_cores`: the average number of cores that something
    other than this process kept busy during the block (resolution ~0.02 core-seconds)."""

    def __enter__(self) -> CpuMeter:
        self._start = (time.perf_counter(), _busy_seconds(), _own_seconds())
        self.foreign_cores = 0.0
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, own = (a - b for a, b in zip((time.perf_counter(), _busy_seconds(), _own_seconds()), self._start))
        self.foreign_cores = max(0.0, (busy - own) / wall) if wall > 0 else 0.0


def wait_for_quiet(max_foreign_cores: float = 0.1, window_s: float = 1.0, timeout_s: float = 120.0) -> float:
    """Sleep until other processes use less than `max_foreign_cores` over a `window_s` window, or
    `timeout_s` passes; returns the last window's foreign load."""
    deadline = time.monotonic() + timeout_s
    while True:
        with CpuMeter() as meter:
            time.sleep(window_s)
        if meter.foreign_cores < max_foreign_cores or time.monotonic() > deadline:
            return meter.foreign_cores
