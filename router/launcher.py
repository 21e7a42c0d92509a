"""`pdserve serve`: start or join Ray, create and check the workers, serve the router, clean up.

The whole topology is validated before anything is created: a placement that the cluster cannot
satisfy fails within seconds with a message naming the missing resource, instead of hanging.
"""

from __future__ import annotations

import logging
import time

import ray

from router.cluster_spec import ClusterSpec
from router.kv_transport_plan import plan_kv_transport
from router.rank_placement import check_rank_room, cpu_groups, place_group, rank_options
from router.ray_instance import connect_ray
from services.engine_config import EngineConfig, check_tensor_parallel
from services.model_config import ModelConfig
from services.worker_runtime import WorkerSpec, actor_class

log = logging.getLogger("pdserve.launcher")


def validate_topology(spec: ClusterSpec, local: bool = False) -> None:
    """Fail fast when the cluster lacks the resources the workers need, or the model is unusable."""
    model = ModelConfig.from_folder(spec.model)
    for role in {role for _, role, _ in spec.roles()}:
        check_tensor_parallel(model, spec.tensor_parallel_size(role))
    totals = ray.cluster_resources()
    share = spec.worker_gpus(totals.get("GPU", 0), local)
    # A tensor-parallel worker's ranks hold a whole GPU each (where there are GPUs).
    gpus = sum(share if spec.tensor_parallel_size(r) == 1 else (share > 0) * spec.tensor_parallel_size(r)
               for _, r, _ in spec.roles())
    if gpus > totals.get("GPU", 0) + 1e-9:
        raise RuntimeError(f"the workers ask for {gpus:g} GPU(s) in all but the cluster has "
                           f"{totals.get('GPU', 0):g}; lower --gpus-per-worker or add GPU nodes")
    needed: dict[str, int] = {}
    for _, role, resource in spec.roles():
        labels = spec.labels(role)
        if labels is not None:
            if not any(labels.items() <= node.get("Labels", {}).items() for node in ray.nodes() if node["Alive"]):
                raise RuntimeError(f"no live node has the labels {labels} that the {role} workers select; start "
                                   f"nodes with ray start --labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
            continue
        needed[resource] = needed.get(resource, 0) + 1
    check_rank_room({role: (sum(r == role for _, r, _ in spec.roles()), spec.tensor_parallel_size(role),
                            resource, spec.labels(role)) for _, role, resource in spec.roles()}, share)
    for resource, count in needed.items():
        have = totals.get(resource, 0)
        if have < count:
            raise RuntimeError(f"the cluster offers {have:g} of resource {resource!r} but {count} worker(s) need "
                               f"one each; start nodes with --resources='{{\"{resource}\": N}}' or change the "
                               f"worker counts")


def wait_for_topology(spec: ClusterSpec, timeout: float, local: bool = False) -> None:
    """`validate_topology`, retried while nodes join (a Kubernetes head starts before its workers)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return validate_topology(spec, local)
        except RuntimeError as error:
            if time.monotonic() > deadline:
                raise
            log.warning("pdserve: waiting for nodes: %s", error)
            time.sleep(2.0)


def start_workers(spec: ClusterSpec, local: bool, node_wait: float = 0.0) -> list:
    """Create every worker actor and wait until each has loaded its model and answers a ping.
    `node_wait` seconds are allowed for nodes with the needed resources or labels to join."""
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    wait_for_topology(spec, node_wait, local)
    roles = spec.roles()
    gpus = spec.worker_gpus(ray.cluster_resources().get("GPU", 0), local)
    sizes = [spec.tensor_parallel_size(role) for _, role, _ in roles]
    groups = cpu_groups(sizes) if (local and spec.pin_cpus) else [None] * len(roles)
    kv = plan_kv_transport(spec, gpus, local)
    if spec.mode == "disaggregated":
        log.warning("pdserve: KV goes from prefill to decode workers over %s (%s)",
                    kv.name + (f" ({kv.tensor_transport})" if kv.tensor_transport else ""), kv.reason)
    actors = []
    for (name, role, resource), cpus in zip(roles, groups):
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        options = dict(name=name, namespace=spec.namespace, num_cpus=0, num_gpus=gpus, max_concurrency=1000,
                       max_restarts=spec.max_restarts)
        if spec.labels(role) is not None:
            options["label_selector"] = dict(spec.labels(role))
        else:
            options["resources"] = {resource: 1}
        if spec.detached:
            options["lifetime"] = "detached"
        placement = {k: v for k, v in options.items() if k not in ("name", "namespace", "lifetime")}
        worker_spec = WorkerSpec(name, role, spec.model, spec.options_for(role), cpus,
                                 peak_flops=spec.peak_flops, peak_bytes_per_second=spec.peak_bytes_per_second,
                                 placement=placement, rank_options=rank_options(gpus), kv_transport=kv.name,
                                 tensor_transport=kv.tensor_transport)
        if worker_spec.tensor_parallel_size > 1:
            options = place_group(options, worker_spec.tensor_parallel_size, spec.detached, spec.startup_timeout)
        actors.append(actor_class(cls, worker_spec).options(**options).remote(worker_spec))
    wait_ready(actors, [n for n, _, _ in roles], spec.startup_timeout)
    return actors


def wait_ready(actors: list, names: list[str], timeout: float) -> None:
    pending = {a.ping.remote(): name for a, name in zip(actors, names)}
    deadline = time.monotonic() + timeout
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeError(f"workers {sorted(pending.values())} did not start within {timeout:.0f} s")
        name = pending.pop(ready[0])
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as error:
            raise RuntimeError(f"worker {name} failed to start: {error}") from None


def stop_workers(actors: list, timeout: float = 10.0) -> None:
    """Shut the workers' engines down (all at once, at most `timeout` seconds), then kill them."""
    calls = []
    for actor in actors:
        try:
            calls.append(actor.shutdown.remote())
        except Exception:  # already dead: nothing to shut down
            pass
    ray.wait(calls, num_returns=len(calls), timeout=timeout)
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # the cluster's control store is gone: so is the actor, soon
            pass


def build_router_state(spec: ClusterSpec, model_name: str, **router_options):
    """The router's state for the workers of `spec`; `router_options` are RouterState fields
    (`api_key`, `max_pending`, ...) and the orchestrator's `local_prefill_tokens`."""
    from router.app import RouterState
    from router.orchestrator import Orchestrator
    from router.worker_pool import WorkerPool
    from services.tokenizer import Tokenizer

    model = ModelConfig.from_folder(spec.model)
    engine_config = EngineConfig(model=spec.model, **spec.engine_options)
    pool = WorkerPool(spec.namespace)
    pool.discover()
    orchestrator = Orchestrator(pool, spec.mode, local_prefill_tokens=router_options.pop("local_prefill_tokens", 0),
                                block_size=engine_config.block_size)
    return RouterState(model_name=model_name, tokenizer=Tokenizer.from_folder(spec.model),
                       max_model_len=engine_config.resolve_max_model_len(model), vocab_size=model.vocab_size,
                       pool=pool, orchestrator=orchestrator, **router_options)


def serve(spec: ClusterSpec, model_name: str, host: str, port: int, address: str | None,
          **router_options) -> None:
    """Run until Ctrl-C / SIGTERM, then stop what was started."""
    from router.server import run_router

    local = connect_ray(spec, address)
    actors = []
    try:
        actors = start_workers(spec, local, node_wait=0.0 if local else spec.startup_timeout)
        for stats in ray.get([a.stats.remote("launcher") for a in actors]):
            log.warning("pdserve: %s runs on %s (node %s)%s; %s", stats.worker_id, stats.device, stats.node_id[:12],
                        f", {stats.quantization} weights" if stats.quantization else "", stats.kernels)
        run_router(spec, model_name, host, port, **router_options)
    finally:
        if not spec.detached:
            # On a cluster, with those `pdserve scale` added; a local Ray goes with everything in it.
            stop_workers(actors if local else _all_workers(spec.namespace) or actors)
        ray.shutdown()


def _all_workers(namespace: str, timeout: float = 10.0) -> list:
    """Every named worker of the deployment, or [] when the cluster does not answer in time (the
    lookup runs on a daemon thread, which a stuck call cannot keep from exiting)."""
    from router.daemon_thread import on_daemon_thread
    from router.worker_pool import named_workers

    try:
        return list(on_daemon_thread(lambda: named_workers(namespace)).result(timeout).values())
    except Exception:  # the cluster going away, or not answering in time
        return []
