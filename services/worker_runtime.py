"""What both worker actors share: building the engine on the right cores, and reporting stats."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.async_engine import AsyncEngine
from services.protocol import WorkerStats
from services.sample_log import SampleLog


@dataclass(frozen=True)
class WorkerSpec:
    """How to build one worker: its id, role, model folder, engine options and (on CPU) cores."""

    worker_id: str
    role: str  # "prefill" | "decode"
    model: str
    engine_options: dict[str, object] = field(default_factory=dict)
    cpu_ids: tuple[int, ...] | None = None  # pin the process here and use one torch thread each
    kv_transport: str = "object_store"  # a key of services.kv_transport.TRANSPORTS
    tensor_transport: str | None = None  # with kv_transport "rdt": RDT's transport, "cuda_ipc" or "nixl"
    peak_flops: float | None = None  # this worker's ceilings, if known; else measured at start-up
    peak_bytes_per_second: float | None = None
    # The Ray actor options it was placed with (resources or labels, GPU share, restarts), so that
    # `pdserve scale` can add workers placed like it.
    placement: dict[str, object] = field(default_factory=dict)
    # A tensor-parallel worker (engine_options["tensor_parallel_size"] > 1): the Ray options of each of
    # its ranks 1..N-1 (num_cpus or num_gpus: what one bundle of its placement group holds).
    rank_options: dict[str, object] = field(default_factory=dict)

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_options.get("tensor_parallel_size", 1))


class WorkerActor:
    """What both worker actors share: the engine on the right cores, ceilings, stats, draining."""

    def __init__(self, spec: WorkerSpec) -> None:
        import ray

        self.spec = spec
        self.rank_group = None  # a tensor-parallel worker's other ranks (services/tensor_parallel_group.py)
        self.engine = self._start_engine()
        self.peaks = hardware_peaks(spec, self.engine)
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        self.queue_log = SampleLog()
        self.draining = False  # routers send it no new work (it is about to be removed)

    def ping(self) -> str:
        return self.spec.worker_id

    def worker_spec(self) -> WorkerSpec:
        return self.spec

    def placement_group(self):
        """The placement group of a tensor-parallel worker's ranks (removed with it), else None."""
        from ray.util import get_current_placement_group

        return get_current_placement_group() if self.spec.tensor_parallel_size > 1 else None

    def drain(self, draining: bool = True) -> None:
        """Take no new requests (False: take them again): routers see it at their next stats poll."""
        self.draining = draining

    def stats(self, reader: str = "") -> WorkerStats:
        """Counters, and the samples `reader` (a router's id) has not had yet."""
        return worker_stats(self.spec, self.engine, self.node_id, self.peaks, self.queue_log, reader, self.draining)

    def shutdown(self) -> None:
        if self.rank_group is not None:
            self.rank_group.stopping = True
        self.engine.shutdown()
        self.engine.engine.close()  # a tensor-parallel group's other ranks stop

    def _start_engine(self) -> AsyncEngine:
        if self.spec.tensor_parallel_size == 1:
            return start_engine(self.spec)
        from services.tensor_parallel_group import start_group_engine

        engine, self.rank_group = start_group_engine(self.spec.model, dict(self.spec.engine_options),
                                                     self.spec.cpu_ids, self.spec.rank_options)
        return AsyncEngine(engine)


def actor_class(cls: type, spec: WorkerSpec):
    """`cls` as a Ray actor class for `spec`: with the KV over RDT, tensor transport is enabled (both
    ends need it; Ray reads it from the class, not from `.options()`)."""
    import ray

    return ray.remote(enable_tensor_transport=True)(cls) if spec.kv_transport == "rdt" else ray.remote(cls)


def start_engine(spec: WorkerSpec) -> AsyncEngine:
    from services.engine import Engine  # torch loads in the worker process only, not in the router

    options = dict(spec.engine_options)
    if spec.cpu_ids:
        # Prefill and decode on one host must not fight over cores: pin, and match torch's threads.
        os.sched_setaffinity(0, spec.cpu_ids)
        options.setdefault("num_threads", len(spec.cpu_ids))
    return AsyncEngine(Engine(model=spec.model, **options))


def hardware_peaks(spec: WorkerSpec, engine: AsyncEngine):
    """The ceilings the efficiency gauges divide by: the spec's, else measured here, now."""
    from services.hardware_peaks import HardwarePeaks

    n = spec.tensor_parallel_size  # the peaks are one device's (rank's); a group's ceiling is n of them
    if spec.peak_flops is not None and spec.peak_bytes_per_second is not None:
        return HardwarePeaks(spec.peak_flops * n, spec.peak_bytes_per_second * n)
    measured = HardwarePeaks.measure(engine.engine.dtype, engine.engine.device)
    return HardwarePeaks((spec.peak_flops or measured.flops) * n,
                         (spec.peak_bytes_per_second or measured.bytes_per_second) * n)


def worker_stats(spec: WorkerSpec, engine: AsyncEngine, node_id: str, peaks, queue_log: SampleLog,
                 reader: str, draining: bool = False) -> WorkerStats:
    """Counters and ceilings, and the queue times `reader` has not had yet (from `queue_log`)."""
    e = engine.engine
    bm = e.block_manager
    phases = e.runner.phase_totals
    # Swapped, not cleared: the engine thread may be appending meanwhile.
    taken, e.scheduler.queue_times = e.scheduler.queue_times, []
    queue_log.extend(taken)
    queue_times = queue_log.take(reader)
    return WorkerStats(
        worker_id=spec.worker_id, role=spec.role, node_id=node_id,
        num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
        num_kv_blocks=bm.num_blocks, num_free_kv_blocks=bm.num_free_blocks,
        num_tokens_processed=e.num_tokens_processed, num_prefix_queries=bm.num_prefix_queries,
        num_prefix_hits=bm.num_prefix_hits, num_steps=engine.num_steps, draining=draining,
        device=str(e.device) if spec.tensor_parallel_size == 1 else f"{e.device} x {spec.tensor_parallel_size} ranks",
        quantization=e.config.quantization, kernels=e.runner.model.kernel_summary,
        num_queued_tokens=_queued_tokens(e.scheduler),
        prefill_flops=phases.prefill_flops, prefill_seconds=phases.prefill_seconds,
        decode_bytes=phases.decode_bytes, decode_seconds=phases.decode_seconds,
        peak_flops=peaks.flops, peak_bytes_per_second=peaks.bytes_per_second, queue_times=queue_times,
    )


def _queued_tokens(scheduler) -> int:
    """Tokens the scheduler's requests have yet to compute, read from the actor's thread while the
    engine thread may change the queues (a copy that raced a change is taken again)."""
    for _ in range(3):
        try:
            return sum(seq.num_uncomputed_tokens for seq in (*scheduler.waiting, *scheduler.running))
        except RuntimeError:  # "deque mutated during iteration"
            continue
    return 0
