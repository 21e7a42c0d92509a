"""Where a worker's ranks go: a tensor-parallel worker of N ranks gets a Ray placement group of N
bundles, STRICT_PACK (one node; torch.distributed's collectives stay on it), one GPU per bundle
where the cluster has GPUs, else one CPU per bundle; bundle 0 also holds the role's resource (or
the group selects the role's node labels). Rank 0, the named worker, runs in bundle 0 and starts
the other ranks in the others (services/tensor_parallel_group.py). Imports no torch.
"""

from __future__ import annotations

import os

import ray
from ray.util import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def rank_unit(gpus: float) -> str:
    """What each rank holds a whole one of: a GPU where the workers get GPUs, else a CPU."""
    return "GPU" if gpus > 0 else "CPU"


def rank_options(gpus: float) -> dict[str, float]:
    """Ray options of ranks 1..N-1: exactly one bundle's resources."""
    return {"num_gpus": 1, "num_cpus": 0} if rank_unit(gpus) == "GPU" else {"num_cpus": 1}


def place_group(options: dict, size: int, detached: bool, startup_timeout: float) -> dict:
    """Actor options for rank 0 of a `size`-rank worker whose single-worker options are `options`
    (resources or label_selector, num_gpus): a placement group is created and waited for; an
    unplaceable one is removed and refused, naming the numbers."""
    unit = rank_unit(options.get("num_gpus", 0))
    bundles = [{unit: 1.0} for _ in range(size)]
    bundles[0].update(options.get("resources", {}))
    labels = options.get("label_selector")
    group = placement_group(bundles, strategy="STRICT_PACK", lifetime="detached" if detached else None,
                            bundle_label_selector=[dict(labels)] * size if labels else None)
    ready, _ = ray.wait([group.ready()], timeout=startup_timeout)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"a tensor-parallel worker of {size} ranks needs {size} {unit}s on one node "
                           f"({bundles[0]} and {size - 1} x {{{unit!r}: 1}}); the cluster could not place it "
                           f"within {startup_timeout:.0f} s")
    own = {k: v for k, v in options.items() if k not in ("resources", "label_selector", "num_cpus", "num_gpus")}
    return {**own, "resources": options.get("resources", {}), **rank_options(options.get("num_gpus", 0)),
            "num_gpus": 1 if unit == "GPU" else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)}


def check_rank_room(groups: dict[str, tuple[int, int, str | None, dict | None]], gpus: float) -> None:
    """Fail fast when no node could hold a role's groups: `groups` maps a role to (groups, ranks
    each, its resource or None, its labels or None). Counts whole groups per node (STRICT_PACK)."""
    unit = rank_unit(gpus)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    for role, (count, size, resource, labels) in groups.items():
        if size == 1:
            continue
        eligible = [n for n in nodes if (labels is None and n["Resources"].get(resource, 0) >= 1)
                    or (labels is not None and labels.items() <= n.get("Labels", {}).items())]
        fits = sum(int(n["Resources"].get(unit, 0) // size) for n in eligible)
        if fits < count:
            most = max((n["Resources"].get(unit, 0) for n in eligible), default=0)
            raise RuntimeError(f"{count} {role} worker(s) of tensor-parallel size {size} need {size} {unit}s each on "
                               f"one node, but the nodes that take {role} workers hold at most {most:g} {unit}s "
                               f"(room for {fits} such group(s)); lower --{role}-tensor-parallel-size or add nodes")


def cpu_groups(sizes: list[int]) -> list[tuple[int, ...] | None]:
    """This host's cores split between workers of `sizes` ranks, in proportion (a rank's share each);
    None for every worker when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // sum(sizes)
    if per == 0:
        return [None] * len(sizes)
    groups, start = [], 0
    for size in sizes:
        groups.append(tuple(cores[start : start + per * size]))
        start += per * size
    return groups
