"""What a deployment runs: the model, the mode, how many workers of each role, where, and with which
engine options. Checked whole when made, so a bad flag fails before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.engine_config import EngineConfig
from services.kv_transport_choice import KV_TRANSPORT_MODES


@dataclass(frozen=True)
class ClusterSpec:
    """What to run: the model, the mode and how many workers of each role, and where."""

    model: str
    mode: str = "disaggregated"  # or "colocated"
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 2
    namespace: str = "pdserve"
    prefill_resource: str = "pd_prefill"
    decode_resource: str = "pd_decode"
    # Place by node labels instead of resources (e.g. {"pdserve/role": "prefill"}); None: by resource.
    prefill_labels: dict[str, str] | None = None
    decode_labels: dict[str, str] | None = None
    engine_options: dict[str, object] = field(default_factory=dict)
    # Per role, on top of engine_options (e.g. {"decode": {"quantization": "int8"}}: full-precision
    # prefill workers, int8 decode workers; the KV they hand over stays in the compute dtype).
    role_engine_options: dict[str, dict[str, object]] = field(default_factory=dict)
    pin_cpus: bool = True  # on one host: give each worker its own cores
    detached: bool = False  # workers outlive this process (a router restart keeps them)
    startup_timeout: float = 300.0
    peak_flops: float | None = None  # each worker's ceilings for the efficiency gauges; None: measured
    peak_bytes_per_second: float | None = None
    # A worker process that dies is started again by Ray, this many times (it reloads the model;
    # the routers find it answering at their next stats poll). Its streams resume elsewhere meanwhile.
    max_restarts: int = 3
    # GPUs each worker asks Ray for (0..1). Ray hides every GPU from an actor that asks for none, so
    # a worker on a GPU node needs a share to see one. None: one each where the cluster has GPUs
    # (on one local host, the GPUs shared evenly among the workers), none without.
    gpus_per_worker: float | None = None
    # Ranks per worker (tensor parallelism; colocated workers are decode workers): each worker is a
    # group of that many rank actors on one node (router/rank_placement.py), still one worker to routers.
    prefill_tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    # How the KV goes from prefill to decode workers: "auto" (the object store, until RDT has served
    # on a GPU: services/kv_transport_choice.py), "object_store", or "rdt" (an error at launch where it cannot work);
    # resolved when the workers start (router/kv_transport_plan.py).
    kv_transport: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.kv_transport not in KV_TRANSPORT_MODES:
            raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORT_MODES)}, got {self.kv_transport!r}")
        if self.kv_transport == "rdt" and self.mode == "colocated":
            raise ValueError("kv_transport rdt needs mode disaggregated (colocated workers hand over no KV)")
        if self.kv_transport == "rdt" and max(self.prefill_tensor_parallel_size, self.decode_tensor_parallel_size) > 1:
            raise ValueError("kv_transport rdt cannot be used with tensor-parallel workers (their KV moves as "
                             "per-rank host slices)")
        for name in ("num_prefill", "num_decode", "num_colocated", "prefill_tensor_parallel_size",
                     "decode_tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.gpus_per_worker is not None and not 0 <= self.gpus_per_worker <= 1:
            raise ValueError(f"gpus_per_worker must be in [0, 1] (one engine uses one device), "
                             f"got {self.gpus_per_worker}")
        for name in ("peak_flops", "peak_bytes_per_second"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be positive, got {value}")
        for role in ("prefill", "decode"):  # refuse bad engine options up front
            EngineConfig(model=self.model, **self.options_for(role))

    def options_for(self, role: str) -> dict[str, object]:
        options = {**self.engine_options, **self.role_engine_options.get(role, {})}
        if self.tensor_parallel_size(role) > 1:
            options["tensor_parallel_size"] = self.tensor_parallel_size(role)
        return options

    def tensor_parallel_size(self, role: str) -> int:
        return self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size

    def labels(self, role: str) -> dict[str, str] | None:
        return self.prefill_labels if role == "prefill" else self.decode_labels

    def roles(self) -> list[tuple[str, str, str]]:
        """(worker name, role, Ray resource) for every worker, prefill first."""
        if self.mode == "colocated":
            return [(f"decode-{i}", "decode", self.decode_resource) for i in range(self.num_colocated)]
        return ([(f"prefill-{i}", "prefill", self.prefill_resource) for i in range(self.num_prefill)]
                + [(f"decode-{i}", "decode", self.decode_resource) for i in range(self.num_decode)])

    def worker_gpus(self, cluster_gpus: float, local: bool) -> float:
        """The GPU share each worker asks for (see `gpus_per_worker`)."""
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        if cluster_gpus < 1:
            return 0.0
        workers = len(self.roles())
        if not local or workers <= cluster_gpus:
            return 1.0
        # A fractional share must fit on one GPU: pack ceil(workers / GPUs) workers onto each.
        return 1.0 / math.ceil(workers / int(cluster_gpus))
