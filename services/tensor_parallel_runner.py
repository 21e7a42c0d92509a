"""`TensorParallel`: one rank's part of a tensor-parallel engine: its shard, its group, the KV moves
between ranks, and the loop the ranks other than 0 run.

Scheduling: rank 0 alone runs the scheduler, the block manager and the sampler; each step it
broadcasts the step's `StepPlan` (token ids, positions, block tables: plain lists, pickled, one
torch.distributed broadcast), and every rank runs the same forward from it. Why not an identical
scheduler on every rank: its inputs are events (arrivals, aborts, KV checks finishing, a router's
lease running out) that reach rank 0's process at moments no other rank sees; keeping N schedulers
identical would mean broadcasting those events at step boundaries anyway, so the plan itself is
the simpler thing to broadcast, and the other ranks hold no request state at all. Sampling runs on
rank 0 only (it gathers the vocab-parallel logits), so the ranks cannot sample apart; a sampled
token reaches the others as an input id of the next plan. Nothing on the step path is a Ray call.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable

import torch

from services.engine_config import EngineConfig
from services.kv_payload import KVPayload
from services.model_config import ModelConfig
from services.roofline import ModelCost
from services.tensor_parallel import GroupSpec, RankGroup, free_address
from services.tensor_parallel_shards import ShardLayout, check_tensor_parallel


class TensorParallel:
    """This rank's shard layout and group; on rank 0, the local follower processes it started."""

    def __init__(self, group: RankGroup, config: ModelConfig, processes: list | None = None) -> None:
        self.group = group
        self.config = config
        self.layouts = [ShardLayout.of(config, r, group.size) for r in range(group.size)]
        self.layout = self.layouts[group.rank]
        self.processes = processes or []

    @classmethod
    def start(cls, config: EngineConfig, model: ModelConfig, device: torch.device, group_spec: GroupSpec | None,
              rank: int) -> TensorParallel | None:
        """Join the group `group_spec` as `rank`; without one, at tensor_parallel_size > 1, start the
        other ranks here as local processes (the offline engine). None for a single engine."""
        size = config.tensor_parallel_size
        if group_spec is None and size == 1:
            return None
        check_tensor_parallel(model, size)
        processes = []
        if group_spec is None:
            group_spec = GroupSpec(free_address(), size)
            options = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
            if options["num_threads"] is None and device.type == "cpu":
                # The ranks share this host's cores: torch's default (every core, per rank) oversubscribes
                # them, and a rank late to each collective stalls all (measured: tiny, 2 cores, 2 threads
                # per rank: 30x slower than one each).
                options["num_threads"] = max(1, len(os.sched_getaffinity(0)) // size)
                torch.set_num_threads(options["num_threads"])
            context = multiprocessing.get_context("spawn")
            for r in range(1, size):
                process = context.Process(target=run_follower, args=(config.model, options, group_spec, r),
                                          name=f"tensor-parallel-rank-{r}", daemon=True)
                process.start()
                processes.append(process)
        if group_spec.size != size:
            raise ValueError(f"the group has {group_spec.size} ranks but tensor_parallel_size is {size}")
        return cls(RankGroup(group_spec, rank, device), model, processes)

    def group_cost(self, cost: ModelCost) -> ModelCost:
        """This rank's work per step, times the ranks: the group's (the norms, replicated, count N times)."""
        n = self.group.size
        return dataclasses.replace(cost, layer_matmul_params=cost.layer_matmul_params * n,
                                   lm_head_params=cost.lm_head_params * n, weight_bytes=cost.weight_bytes * n,
                                   kv_bytes_per_token=cost.kv_bytes_per_token * n)

    def export_kv(self, kv: torch.Tensor, dtype: torch.dtype) -> KVPayload | None:
        """kv: this rank's heads of one sequence [L, 2, T, K_rank, Dh]. Rank 0 returns the payload with
        one slice per distinct head range (the first replica of each sends it); the others None."""
        from services.model_runner import DTYPE_NAMES, to_wire

        if not self.group.is_driver:
            if self.layout.kv_owner:
                self.group.send(kv, 0)
            return None
        parts = [(self.layout.kv_head_start, to_wire(kv.cpu(), dtype))]
        for r, layout in enumerate(self.layouts[1:], start=1):
            if layout.kv_owner:
                shape = (*kv.shape[:3], layout.num_kv_heads, kv.shape[4])
                buffer = self.group.recv(torch.empty(shape, dtype=dtype, device=kv.device), r)
                parts.append((layout.kv_head_start, to_wire(buffer.cpu(), dtype)))
        return KVPayload.from_slices(parts, DTYPE_NAMES[dtype])

    def import_kv(self, payload: KVPayload | None, num_tokens: int, slots: torch.Tensor, kv_slots: torch.Tensor
                  ) -> None:
        """Copy one sequence's KV into every rank's pool [L, 2, S, K_rank, Dh]: rank 0 holds the
        payload (any slicing, from a group of any size) and sends each rank its heads."""
        from services.model_runner import copy_heads, from_wire

        dtype = kv_slots.dtype
        if not self.group.is_driver:
            shape = (kv_slots.shape[0], 2, num_tokens, self.layout.num_kv_heads, kv_slots.shape[4])
            kv_slots.index_copy_(2, slots, self.group.recv(torch.empty(shape, dtype=dtype, device=kv_slots.device), 0))
            return
        for r, layout in enumerate(self.layouts[1:], start=1):
            pieces = payload.heads(layout.kv_head_start, layout.num_kv_heads)
            self.group.send(torch.cat([from_wire(p, dtype) for _, p in pieces], dim=3).to(kv_slots.device), r)
        copy_heads(kv_slots, slots, payload.heads(self.layout.kv_head_start, self.layout.num_kv_heads), dtype)

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop, wait for local ones; every rank: leave the group."""
        if self.group.is_driver:
            try:
                self.group.broadcast(None)
            except RuntimeError:  # a rank is already gone: nothing left to stop
                pass
            for process in self.processes:
                process.join(timeout=30)
        self.group.close()


def follow(runner, should_stop: Callable[[], bool] = lambda: False) -> None:
    """A rank other than 0: run every plan rank 0 broadcasts until it sends None (shutdown)."""
    group = runner.parallel.group
    while not should_stop() and (plan := group.broadcast(None)) is not None:
        runner.execute(plan)


def run_follower(model: str, options: dict, group_spec: GroupSpec, rank: int) -> None:
    """A follower rank's whole life: build the engine (its shard of the weights), follow, leave."""
    from services.engine import Engine

    engine = Engine(model, group_spec=group_spec, rank=rank, **options)
    try:
        follow(engine.runner)
    finally:
        engine.close()
