"""How a request's KV reaches the decode worker, behind one small interface (imports no torch).

The prefill worker yields the KV as its stream's second item; the router wraps that reference in
an opaque handle with `handle()` and passes it on untouched; the decode worker turns the handle
back into the KV with `fetch()`. Two transports: the object store (a host `KVPayload`) and Ray
Direct Transport (a `DeviceKV` that stays in the prefill worker's device memory until the decode
worker reads it). The handle is the same for both, so the router does not know which one runs.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import ray

from services.kv_payload import KVPayload

if TYPE_CHECKING:
    from services.device_kv import DeviceKV


class KVTransport(ABC):
    name: str

    @abstractmethod
    def handle(self, kv_ref: object) -> object:
        """What the router sends to the decode worker for the KV object `kv_ref` it owns."""

    @abstractmethod
    async def fetch(self, handle: object) -> KVPayload | DeviceKV:
        """The KV behind `handle`, on the decode worker (no copy beyond the transfer). Any error
        (the object lost with its node, its owner dead) means the KV is lost: the caller recomputes."""


class ObjectStoreTransport(KVTransport):
    """The KV travels through Ray's object store. The handle is `[ref]`: a reference nested in a
    list is not resolved by Ray before the call, so the decode worker fetches it itself (timing the
    transfer) and the store frees the object once the worker has copied it and the router has
    dropped its own reference. numpy reads the fetched object in place (zero-copy)."""

    name = "object_store"

    def handle(self, kv_ref: object) -> list:
        return [kv_ref]

    async def fetch(self, handle: list) -> KVPayload:
        return await handle[0]


class DirectTransport(KVTransport):
    """The KV travels over Ray Direct Transport (CUDA IPC on one host, NIXL across hosts).

    The prefill worker puts its `DeviceKV` itself, `ray.put(kv, _tensor_transport=...)`, and yields
    `[rdt_ref]`: a ref put by its owner carries its transport metadata at once, so it may be passed
    on (a ref returned by a tensor_transport task may not: Ray issue #59644). The router's handle is
    `[ref]` of that list, as for the object store. `fetch` awaits the list, then reads the tensors
    with `ray.get` on a thread (an RDT ref cannot be awaited). The object stays in the prefill
    worker's memory until the router and this worker have dropped their refs."""

    name = "rdt"

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s  # a transfer that hangs (its owner unreachable) fails as lost

    def handle(self, kv_ref: object) -> list:
        return [kv_ref]

    async def fetch(self, handle: list) -> DeviceKV:
        (rdt_ref,) = await handle[0]
        return await asyncio.to_thread(ray.get, rdt_ref, timeout=self.timeout_s)


TRANSPORTS: dict[str, type[KVTransport]] = {t.name: t for t in (ObjectStoreTransport, DirectTransport)}
