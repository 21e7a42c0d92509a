"""`pdserve scale`: change how many prefill and decode workers a running deployment has, with its
routers running (they find new workers, and stop choosing removed ones, at their stats polls).

A new worker copies an existing one of its role: model, engine options, ceilings and placement
(the Ray resources or node labels, GPU share and restarts it was created with); it is detached, so
it outlives this command. A removed worker first drains: routers see it draining at their next
poll and send it nothing new; once it is idle (or `drain_timeout` has passed) it is killed, and
whatever it still ran resumes elsewhere (a decode stream continues on another decode worker with no
token lost or repeated; a prefill is retried on another prefill worker).
"""

from __future__ import annotations

import dataclasses
import time

import ray

from router.rank_placement import place_group, rank_unit
from router.worker_pool import named_workers, worker_order
from services.worker_runtime import actor_class

ROLES = ("prefill", "decode")
POLL_GRACE = 2.5  # seconds: a router polls each second; two polls after draining, none chooses it


def scale(namespace: str, wanted: dict[str, int], drain_timeout: float = 30.0, startup_timeout: float = 300.0,
          tensor_parallel_sizes: dict[str, int] | None = None) -> dict[str, list[str]]:
    """Add or remove workers until each role in `wanted` has that many. Returns the names added and
    removed. Refuses, before changing anything, a count below 1, a role with no worker to copy, or
    (for workers placed by resource) a cluster without the free resources for the new ones.
    `tensor_parallel_sizes`: the ranks of each role's new workers (default: the copied worker's);
    a tensor-parallel worker is added and removed as a whole group."""
    for role, size in (tensor_parallel_sizes or {}).items():
        if role not in ROLES or size < 1:
            raise ValueError(f"a tensor-parallel size is at least 1 per role; got {role}={size}")
    workers = named_workers(namespace)
    plan: dict[str, tuple[list[str], list[str]]] = {}
    for role, count in wanted.items():
        if role not in ROLES or count < 1:
            raise ValueError(f"every role keeps at least one worker; got {role}={count}")
        have = [name for name in workers if name.startswith(role + "-")]
        if not have:
            raise RuntimeError(f"namespace {namespace!r} has no {role} worker to copy (start it with pdserve serve)")
        used = {worker_order(name)[1] for name in have}
        free = (i for i in range(len(have) + count) if i not in used)
        plan[role] = ([f"{role}-{next(free)}" for _ in range(count - len(have))], have[count:])
    added = _add(namespace, workers, plan, startup_timeout, tensor_parallel_sizes or {})
    removed = [name for _, (_, gone) in plan.items() for name in gone]
    _remove(namespace, {name: workers[name] for name in removed}, drain_timeout)
    return {"added": added, "removed": removed}


def _add(namespace: str, workers: dict[str, object], plan: dict, startup_timeout: float,
         tensor_parallel_sizes: dict[str, int]) -> list[str]:
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker
    from router.launcher import wait_ready

    templates = {role: ray.get(workers[next(n for n in workers if n.startswith(role + "-"))].worker_spec.remote())
                 for role, (new, _) in plan.items() if new}
    for role, size in tensor_parallel_sizes.items():
        if role in templates:
            options = {k: v for k, v in templates[role].engine_options.items() if k != "tensor_parallel_size"}
            templates[role] = dataclasses.replace(templates[role], engine_options=(
                {**options, "tensor_parallel_size": size} if size > 1 else options))
    _check_room({role: (len(plan[role][0]), spec.placement, spec.tensor_parallel_size)
                 for role, spec in templates.items()})
    names, actors = [], []
    for role, template in templates.items():
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        for name in plan[role][0]:
            spec = dataclasses.replace(template, worker_id=name, cpu_ids=None)  # unpinned: cores were handed out
            options = dict(template.placement, name=name, namespace=namespace, lifetime="detached")
            if spec.tensor_parallel_size > 1:  # a group like the template's: a placement group of its own
                options = place_group(options, spec.tensor_parallel_size, True, startup_timeout)
            actors.append(actor_class(cls, spec).options(**options).remote(spec))  # like its template: RDT too
            names.append(name)
    try:
        wait_ready(actors, names, startup_timeout)
    except RuntimeError:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    return names


def _check_room(additions: dict[str, tuple[int, dict, int]]) -> None:
    """Fail fast, before creating anything, when the cluster lacks the free resources (custom
    resources and GPUs; for tensor-parallel groups a CPU or GPU per rank) for every worker to add.
    Workers placed by node labels are not checked here: they wait for a matching node, up to the
    startup timeout (so does a group whose ranks fit the cluster but not one node)."""
    needs: dict[str, float] = {}
    for count, placement, ranks in additions.values():
        gpus = placement.get("num_gpus", 0)
        each_worker = {**placement.get("resources", {}), "GPU": gpus}
        if ranks > 1:
            each_worker[rank_unit(gpus)] = ranks
        for resource, each in each_worker.items():
            needs[resource] = needs.get(resource, 0) + each * count
    free = ray.available_resources()
    for resource, need in needs.items():
        if need and free.get(resource, 0) + 1e-9 < need:
            raise RuntimeError(f"the workers to add need {need:g} of {resource!r} but the cluster has "
                               f"{free.get(resource, 0):g} free; add nodes first")


def _remove(namespace: str, doomed: dict[str, object], drain_timeout: float) -> None:
    """Drain, wait until idle (or `drain_timeout`), kill. A worker that dies meanwhile is done."""
    if not doomed:
        return
    for actor in doomed.values():
        _quietly(lambda a=actor: ray.get(a.drain.remote(), timeout=10))
    time.sleep(POLL_GRACE)  # every router has polled since (at the default 1 s): none sends it anything new
    deadline = time.monotonic() + drain_timeout
    busy = dict(doomed)
    while busy and time.monotonic() < deadline:
        for name, actor in list(busy.items()):
            stats = _quietly(lambda a=actor: ray.get(a.stats.remote("scaler"), timeout=10))
            if stats is None or (stats.num_running == 0 and stats.num_waiting == 0):
                del busy[name]
        time.sleep(0.2)
    groups = [_quietly(lambda a=actor: ray.get(a.placement_group.remote(), timeout=10)) for actor in doomed.values()]
    for actor in doomed.values():
        _quietly(lambda a=actor: ray.kill(a, no_restart=True))  # a group's other ranks die with rank 0
    for group in groups:
        if group is not None:  # a tensor-parallel worker's bundles, free again
            _quietly(lambda g=group: ray.util.remove_placement_group(g))


def _quietly(call):
    """`call()`, or None if the worker is already gone."""
    try:
        return call()
    except Exception:  # a dead actor, a timeout: nothing left to wait for
        return None
