"""How a request's KV reaches the decode worker, behind one small interface (imports no torch).

The prefill worker yields the KV as its stream's second item; the router wraps that reference in
an opaque handle with `handle()` and passes it on untouched; the decode worker turns the handle
back into the KV with `fetch()`. Two transports: the object store (a host `KVPayload`) and Ray
Direct Transport (a `DeviceKV` that stays in the prefill worker's device memory until the decode
worker reads it). The handle is the same for both, so the router does not know which one runs.
"""

from __future__ import annotations

import asyncio
import time
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
    `[rdt_ref, its own actor handle, lease key]` (`KVLeases`): a ref put by its owner carries its
    transport metadata at once, so it may be passed on (a ref returned by a tensor_transport task may
    not: Ray issue #59644). The router's handle is `[ref]` of that list, as for the object store.
    `fetch` awaits the list, reads the tensors with `ray.get` on a thread (an RDT ref cannot be
    awaited), then ends the owner's lease: the object stays in the prefill worker's memory until
    then, or until the lease runs out."""

    name = "rdt"

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s  # a transfer that hangs (its owner unreachable) fails as lost

    def handle(self, kv_ref: object) -> list:
        return [kv_ref]

    async def fetch(self, handle: list) -> DeviceKV:
        rdt_ref, owner, lease = await handle[0]
        try:
            return await asyncio.to_thread(ray.get, rdt_ref, timeout=self.timeout_s)
        finally:  # read, or lost: either way the owner may let go
            owner.release_kv.remote(lease)


class KVLeases:
    """The RDT refs a prefill worker has handed out, held by the worker itself until the decode
    worker has read them, the router has dropped them unread (`release`), or `lease_s` passes (both
    died).

    Why the owner holds its own ref: Ray 2.60 can free an object whose ref travels nested in a
    streaming generator's item before the reader's borrow is counted (ray-project/ray#58080; in a
    bare repro here 245 of 300 such refs were gone when the reader asked, none while the owner held
    them). The KV would be recomputed: correct, but a prefill thrown away."""

    def __init__(self, lease_s: float = 120.0, clock=time.monotonic) -> None:
        self.lease_s, self.clock = lease_s, clock
        self._leases: dict[str, tuple[float, object | None]] = {}  # key -> (deadline, ref; None: released first)

    def hold(self, key: str, ref) -> None:
        """Keep `ref` alive under `key`, unless `key` was released already."""
        self.expire()
        if key in self._leases and self._leases[key][1] is None:
            del self._leases[key]  # a router whose client left at once may release before the put
            return
        self._leases[key] = (self.clock() + self.lease_s, ref)

    def release(self, key: str) -> None:
        self.expire()
        if self._leases.pop(key, None) is None:  # not held (yet): remembered for a lease's length
            self._leases[key] = (self.clock() + self.lease_s, None)

    def expire(self) -> int:
        """Forget the leases that ran out; how many held a ref."""
        now = self.clock()
        gone = [key for key, (deadline, _) in self._leases.items() if deadline <= now]
        return sum(self._leases.pop(key)[1] is not None for key in gone)

    def __len__(self) -> int:
        """Refs held."""
        return sum(ref is not None for _, ref in self._leases.values())


TRANSPORTS: dict[str, type[KVTransport]] = {t.name: t for t in (ObjectStoreTransport, DirectTransport)}
