"""The Ray instance `pdserve serve` runs in: one of its own on this machine, or a cluster it joins."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from router.launcher import ClusterSpec


def init_local_ray(spec: ClusterSpec, num_cpus: int | None = None) -> None:
    """A one-machine Ray instance of its own that advertises both roles; the dashboard stays off.

    `address="local"`, not Ray's default None: that joins the cluster named in RAY_ADDRESS or the
    one the last `ray start` on this host recorded (/tmp/ray/ray_current_cluster), whoever started
    it, and then refuses num_cpus. "local" always starts a new instance (on free ports)."""
    num_workers = len(spec.roles())
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), namespace=spec.namespace,
             include_dashboard=False, resources={spec.prefill_resource: num_workers, spec.decode_resource: num_workers},
             logging_level=logging.WARNING)


def connect_ray(spec: ClusterSpec, address: str | None) -> bool:
    """Start a Ray instance of its own (`address` None) or join a cluster (`auto`: RAY_ADDRESS, else
    the last `ray start` on this host; or HOST:PORT). Returns whether the instance is local."""
    if address is None:
        init_local_ray(spec)
        return True
    ray.init(address=address, namespace=spec.namespace, logging_level=logging.WARNING)
    return False
