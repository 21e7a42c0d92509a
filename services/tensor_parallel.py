"""`RankGroup`: the ranks of one tensor-parallel engine, joined by torch.distributed (gloo on CPU,
NCCL on CUDA), and the few collectives the sharded model and the step plan use.

One group per process (torch.distributed's default group): each rank is its own process (a Ray
actor, or a process the offline engine spawns). Rank 0 schedules; every step it broadcasts the
step's plan, then all ranks run the same forward (services/tensor_parallel_runner.py).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def free_address() -> str:
    """host:port for the group's rendezvous store, on this host (the node rank 0 runs on)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = "127.0.0.1"
    return f"{host}:{port}"


@dataclass(frozen=True)
class GroupSpec:
    """Where the ranks meet: `address` (host:port of rank 0's store), `size` ranks, and how long a
    collective may wait for a missing rank before it fails (a dead rank fails it sooner: gloo sees
    the connection close)."""

    address: str
    size: int
    timeout_s: float = 300.0


def _collective(method):
    """A collective that fails (a rank died: gloo sees its connection close) calls `on_failure` first."""

    @functools.wraps(method)
    def wrapper(self: RankGroup, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as error:
            if self.on_failure is not None:
                self.on_failure(error)
            raise

    return wrapper


class RankGroup:
    """This process's rank in a group; collectives over all ranks. `size == 1` needs no group.

    `on_failure(error)` runs when a collective fails: a Ray worker exits there (a group with a dead
    rank is of no use, and its streams resume elsewhere only if the whole worker goes down, not if
    each request fails with the error)."""

    on_failure: Callable[[BaseException], None] | None = None

    def __init__(self, spec: GroupSpec, rank: int, device: torch.device) -> None:
        if not 0 <= rank < spec.size:
            raise ValueError(f"rank must be in [0, {spec.size}), got {rank}")
        self.spec, self.rank, self.size, self.device = spec, rank, spec.size, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if dist.is_initialized():
            raise RuntimeError("this process is already a rank of a tensor-parallel group")
        dist.init_process_group(self.backend, init_method=f"tcp://{spec.address}", rank=rank,
                                world_size=spec.size, timeout=timedelta(seconds=spec.timeout_s))

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @_collective
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (the row-parallel layers' partial products)."""
        dist.all_reduce(x)
        return x

    @_collective
    def gather_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` [M, n] along the last dim, on rank 0 ([M, size * n]); None elsewhere.
        Only rank 0 samples, so only it needs the vocab-parallel logits whole."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    @_collective
    def broadcast(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (pickled; followers pass None)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return box[0]

    @_collective
    def send(self, x: torch.Tensor, dst: int) -> None:
        dist.send(x.contiguous(), dst)

    @_collective
    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(x, src)
        return x

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
