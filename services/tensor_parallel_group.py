"""A tensor-parallel worker on Ray: rank 0 is the named worker actor itself (the router sees one
worker, with one name, API and stats); it starts ranks 1..N-1 as `RankActor`s in the other bundles
of the placement group it runs in (STRICT_PACK: one node; a GPU per bundle where there are GPUs),
and the ranks meet through torch.distributed.

Death of any rank takes the whole group down: a failed collective, or a rank's `follow` call
ending, makes rank 0 exit its process; Ray then ends the other ranks (rank 0 owns them), the
routers see the worker's channel break and resume its streams on another worker, and Ray restarts
rank 0 (up to the worker's max_restarts), which starts a fresh set of ranks.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from services.tensor_parallel import GroupSpec, free_address

log = logging.getLogger("pdserve.tensor_parallel")


def split_cpus(cpu_ids: tuple[int, ...] | None, size: int) -> list[tuple[int, ...] | None]:
    """A worker's cores, split evenly between its ranks (None each when there are fewer cores than ranks)."""
    if not cpu_ids or len(cpu_ids) < size:
        return [None] * size
    per = len(cpu_ids) // size
    return [tuple(cpu_ids[r * per : (r + 1) * per]) for r in range(size)]


def _die(error: BaseException) -> None:
    log.error("pdserve: a rank of this tensor-parallel group failed (%s); the group goes down", error)
    os._exit(1)


class RankActor:
    """Rank r > 0 of a tensor-parallel worker: its shard of the model and of the KV pool, running
    the plans rank 0 broadcasts. It holds no request state."""

    def __init__(self, model: str, options: dict, group_spec: GroupSpec, rank: int,
                 cpu_ids: tuple[int, ...] | None) -> None:
        from services.engine import Engine

        if cpu_ids:
            os.sched_setaffinity(0, cpu_ids)
            options = {**options, "num_threads": options.get("num_threads") or len(cpu_ids)}
        self.rank = rank
        self.engine = Engine(model, group_spec=group_spec, rank=rank, **options)
        self.engine.tensor_parallel.group.on_failure = _die

    def ping(self) -> int:
        return self.rank

    def follow(self) -> None:
        """Run rank 0's plans until it stops the group (returns) or a rank dies (this process exits)."""
        from services.tensor_parallel_runner import follow

        follow(self.engine.runner)
        self.engine.close()


@dataclass
class RankGroupLeader:
    """Rank 0's hold on the other ranks: their actors, their `follow` calls, and the watch on them."""

    ranks: list
    follows: list
    stopping: bool = False

    def watch(self) -> None:
        """Exit this process as soon as any other rank's `follow` ends, unless the group is stopping."""
        import ray

        def wait() -> None:
            done, _ = ray.wait(self.follows, num_returns=1, timeout=None)
            if not self.stopping:
                try:
                    ray.get(done[0])
                    error: BaseException = RuntimeError("a rank left the group")
                except Exception as failure:  # the rank's actor died
                    error = failure
                _die(error)

        threading.Thread(target=wait, name="rank-watch", daemon=True).start()


def _watch_start(ranks: list) -> None:
    """Exit this process if a rank fails to start: rank 0 would otherwise wait for it at the
    rendezvous until the group's timeout (a rank's `ping` answers once its engine is built)."""
    import ray

    def wait() -> None:
        try:
            ray.get([rank.ping.remote() for rank in ranks])
        except Exception as error:  # the rank's actor died starting
            _die(error)

    threading.Thread(target=wait, name="rank-start-watch", daemon=True).start()


def start_group_engine(model: str, options: dict, cpu_ids: tuple[int, ...] | None, rank_options: dict):
    """In rank 0's actor: start ranks 1..N-1 in this actor's placement group, join them, and return
    (this rank's Engine, the leader). `rank_options`: the Ray options of each other rank (its CPU or GPU)."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from services.engine import Engine

    size = int(options["tensor_parallel_size"])
    placement = get_current_placement_group()
    if placement is None:
        raise RuntimeError(f"a tensor-parallel worker (size {size}) must run in a placement group of {size} bundles")
    group_spec = GroupSpec(free_address(), size)
    cpus = split_cpus(cpu_ids, size)
    ranks = [ray.remote(RankActor).options(
        **rank_options, max_concurrency=2,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=r),
    ).remote(model, options, group_spec, r, cpus[r]) for r in range(1, size)]
    _watch_start(ranks)
    own = dict(options)
    if cpus[0]:
        os.sched_setaffinity(0, cpus[0])
        own["num_threads"] = own.get("num_threads") or len(cpus[0])
    engine = Engine(model, group_spec=group_spec, rank=0, **own)  # waits for every rank to join
    engine.tensor_parallel.group.on_failure = _die
    leader = RankGroupLeader(ranks, [r.follow.remote() for r in ranks])
    leader.watch()
    return engine, leader
