"""How a request's KV reaches the decode worker, behind one small interface (imports no torch).

The prefill worker returns the KV as its second return value; the router wraps that reference in
an opaque handle with `handle()` and passes it on untouched; the decode worker turns the handle
back into a `KVPayload` with `fetch()`. A GPU transport (Ray Direct Transport over NCCL/NIXL,
where the object stays in GPU memory) implements the same two methods, and the router does not
change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from services.kv_payload import KVPayload


class KVTransport(ABC):
    name: str

    @abstractmethod
    def handle(self, kv_ref: object) -> object:
        """What the router sends to the decode worker for the KV object `kv_ref` it owns."""

    @abstractmethod
    async def fetch(self, handle: object) -> KVPayload:
        """The payload behind `handle`, on the decode worker's node (no copy beyond the transfer)."""


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


TRANSPORTS: dict[str, type[KVTransport]] = {ObjectStoreTransport.name: ObjectStoreTransport}
