"""The router's view of the workers: find them by name, pick the least loaded, track health.

Load is what this router has sent and not yet seen finish (outstanding prompt tokens for prefill,
outstanding sequences for decode), refined for decode by the free KV blocks each worker last
reported. Several routers may share one pool; each balances its own traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import ray

from router.errors import APIError

log = logging.getLogger("pdserve.router")
MAX_MISSED_POLLS = 3  # stats polls in a row a worker may leave unanswered (timed out) before it counts as dead


@dataclass(slots=True)
class WorkerHandle:
    name: str  # "prefill-0", "decode-1", ...
    role: str
    actor: object  # ray.actor.ActorHandle
    outstanding: int = 0  # prompt tokens (prefill) or sequences (decode) in flight from this router
    free_kv_blocks: int = 0
    alive: bool = True
    missed_polls: int = 0  # stats polls in a row it did not answer in time (a busy host, or hung)
    draining: bool = False  # about to be removed: chosen for nothing new
    # What it last reported for all routers (`outstanding` is this router's share, up to date).
    reported_requests: int = 0  # running and waiting
    reported_queued_tokens: int = 0
    # From its stats: prompt tokens it computes per busy second (prefill workers), its matmul ceiling.
    prefill_tokens_per_second: float = 0.0
    busy_totals: tuple[int, float] = (0, 0.0)  # (tokens computed, busy seconds) at its last report
    recent_work: tuple[float, float] = (0.0, 0.0)  # the same, decaying sums of the recent reports' increments
    peak_flops: float = 0.0


def named_workers(namespace: str, known: dict[str, object] | None = None) -> dict[str, object]:
    """Every pdserve worker actor in `namespace`, by name (`prefill-0`, `decode-1`, ...), in order.
    Handles in `known` are reused (one control-store lookup per new name only)."""
    known = known or {}
    handles = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != namespace or name.split("-", 1)[0] not in ("prefill", "decode"):
            continue
        try:
            handles[name] = known.get(name) or ray.get_actor(name, namespace=namespace)
        except ValueError:  # removed meanwhile
            pass
    return dict(sorted(handles.items(), key=lambda item: worker_order(item[0])))


def _track_prefill_rate(worker: WorkerHandle, stats) -> None:
    """Tokens a prefill worker computes per busy second, over its recent work: each report's new
    tokens and busy seconds are added to sums that decay by 0.8 per report, and the rate is their
    ratio (a window weighs as much as the work in it, so a quiet window with one tiny prompt does
    not drag it down). Busy time is all of its steps' (a one-token prompt's step is booked as
    decode in the worker's phase totals)."""
    tokens, seconds = stats.num_tokens_processed, stats.prefill_seconds + stats.decode_seconds
    last_tokens, last_seconds = worker.busy_totals
    if tokens < last_tokens or seconds < last_seconds:  # a restarted worker counts from zero again
        last_tokens, last_seconds = 0, 0.0
    worker.busy_totals = (tokens, seconds)
    recent_tokens, recent_seconds = worker.recent_work
    worker.recent_work = (0.8 * recent_tokens + tokens - last_tokens, 0.8 * recent_seconds + seconds - last_seconds)
    if worker.recent_work[1] > 0:
        worker.prefill_tokens_per_second = worker.recent_work[0] / worker.recent_work[1]


def running_average(old: float | None, new: float, weight: float = 0.2) -> float:
    """An exponential running average; `weight` is the newest sample's share."""
    return new if old is None else (1 - weight) * old + weight * new


def worker_order(name: str) -> tuple[str, int]:
    role, index = name.split("-", 1)
    return role, int(index) if index.isdigit() else -1


class WorkerPool:
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.workers: dict[str, WorkerHandle] = {}
        self.kv_bytes_per_second: float | None = None  # the decode workers' KV fetches, running average
        self.reader_id = uuid.uuid4().hex  # each router gets every worker sample once, whoever else polls

    def lookup(self) -> dict[str, object]:
        """The named workers the control store lists now, by name: a blocking Ray call, which the router
        makes off its event loop (app.py)."""
        live = {name: w.actor for name, w in self.workers.items() if w.alive}
        return named_workers(self.namespace, known=live)

    def discover(self, found: dict[str, object] | None = None) -> list[str]:
        """Attach to every named pdserve worker in the namespace (`found`: a `lookup()` made before; None:
        made now), and forget those that are gone (`pdserve scale` removed them). A worker that stopped
        answering is looked up again: its name may now belong to a new actor (removed, then added back).
        Returns the names whose worker was forgotten or replaced."""
        found = self.lookup() if found is None else found
        changed = [name for name, w in self.workers.items()
                   if name not in found or found[name]._actor_id != w.actor._actor_id]
        for name in changed:
            del self.workers[name]
        for name, actor in found.items():
            if name not in self.workers:
                self.workers[name] = WorkerHandle(name, name.split("-", 1)[0], actor)
        return changed

    def role(self, role: str) -> list[WorkerHandle]:
        """The live workers of `role` that take new work (not draining)."""
        return [w for w in self.workers.values() if w.role == role and w.alive and not w.draining]

    def best(self, role: str, cached: dict[str, int] | None = None) -> WorkerHandle | None:
        """The live worker of `role` that `claim` would pick now, or None."""
        candidates = self.role(role)
        if not candidates:
            return None
        cached = cached or {}
        if role == "decode":  # requests, then a cached prefix, then room for the KV
            return min(candidates, key=lambda w: (w.outstanding, -cached.get(w.name, 0), -w.free_kv_blocks))
        return min(candidates, key=lambda w: w.outstanding - cached.get(w.name, 0))

    @contextlib.contextmanager
    def claim(self, role: str, load: int, cached: dict[str, int] | None = None) -> Iterator[WorkerHandle]:
        """The least loaded live worker of `role`, charged `load` until the block exits. `cached`:
        tokens of this prompt a worker likely has cached. For prefill it lowers that worker's cost
        (the choice minimizes queued tokens plus the tokens it must compute); for decode (load:
        requests) it breaks ties between equally loaded workers."""
        worker = self.best(role, cached)
        if worker is None:
            raise APIError(503, f"no {role} worker is alive", retry_after=1)
        worker.outstanding += load
        try:
            yield worker
        finally:
            worker.outstanding -= load

    async def poll(self, timeout: float = 2.0) -> list:
        """Every worker's `stats()`; refreshes health and free KV. A worker whose actor is dead, or that
        leaves MAX_MISSED_POLLS polls in a row unanswered for `timeout` seconds, is marked dead until
        it answers again. One call per poll: a report carries the samples (KV transfers,
        queue times) gathered since the previous one, so each must be recorded."""
        async def one(worker: WorkerHandle):
            try:
                stats = await asyncio.wait_for(worker.actor.stats.remote(self.reader_id), timeout)
            except Exception as error:
                # A dead actor cannot take requests; a slow answer may be a busy host, so only
                # MAX_MISSED_POLLS in a row mark it dead (a call made meanwhile still fails over).
                worker.missed_polls += 1
                if worker.alive and (worker.missed_polls >= MAX_MISSED_POLLS or not isinstance(error, TimeoutError)):
                    log.warning("worker %s is not answering: %r", worker.name, error)
                    worker.alive = False
                return None
            worker.free_kv_blocks, worker.alive, worker.peak_flops = stats.num_free_kv_blocks, True, stats.peak_flops
            worker.missed_polls = 0
            worker.draining = stats.draining
            worker.reported_requests = stats.num_running + stats.num_waiting
            worker.reported_queued_tokens = stats.num_queued_tokens
            if worker.role == "prefill":
                _track_prefill_rate(worker, stats)
            for seconds, num_bytes in stats.kv_transfers:
                self.kv_bytes_per_second = running_average(self.kv_bytes_per_second, num_bytes / max(seconds, 1e-6))
            return stats

        return [s for s in await asyncio.gather(*(one(w) for w in self.workers.values())) if s is not None]
