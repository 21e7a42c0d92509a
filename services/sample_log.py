"""Samples a worker gathers between stats reports (KV transfer times, queue times), kept for every
reader: each router polling a worker gets each sample once, however many routers poll it (taking
them from the worker, as the first design did, gave each router only the samples no other router
had asked for first)."""

from __future__ import annotations

import time


class SampleLog:
    def __init__(self, max_samples: int = 10_000, reader_ttl: float = 60.0) -> None:
        self.max_samples = max_samples  # past it the oldest go, read or not
        self.reader_ttl = reader_ttl  # a reader silent this long is forgotten (a router that went away)
        self._samples: list = []
        self._base = 0  # the position of _samples[0] in the whole sequence
        self._cursors: dict[str, int] = {}  # reader -> position of its next sample
        self._last_read: dict[str, float] = {}

    def extend(self, samples) -> None:
        self._samples.extend(samples)
        if len(self._samples) > self.max_samples:
            self._trim_to(self._base + len(self._samples) - self.max_samples)

    def take(self, reader: str) -> tuple:
        """The samples `reader` has not had yet (a new reader: all that are kept)."""
        now = time.monotonic()
        for stale in [r for r, t in self._last_read.items() if now - t > self.reader_ttl]:
            del self._cursors[stale], self._last_read[stale]
        start = max(self._cursors.get(reader, self._base), self._base)
        taken = tuple(self._samples[start - self._base :])
        self._cursors[reader] = self._base + len(self._samples)
        self._last_read[reader] = now
        self._trim_to(min(self._cursors.values()))
        return taken

    def _trim_to(self, position: int) -> None:
        del self._samples[: position - self._base]
        self._base = position
