"""The KV transports' two methods, without Ray: the handle the router sends, and what `fetch` does
with it (the transfers themselves run in tests/test_e2e_rdt.py and tests/test_e2e_disaggregated.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services import kv_transport
from services.kv_transport import TRANSPORTS, DirectTransport, KVLeases, ObjectStoreTransport


def resolved(value) -> asyncio.Future:
    """What awaiting a Ray ref gives: here, an already resolved future."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def test_transports_by_name_and_their_handles():
    assert TRANSPORTS == {"object_store": ObjectStoreTransport, "rdt": DirectTransport}
    ref = object()
    assert ObjectStoreTransport().handle(ref)[0] is ref and DirectTransport().handle(ref)[0] is ref
    assert len(DirectTransport().handle(ref)) == 1


class Owner:
    """Stands in for the prefill worker's actor handle: records the leases it is told to end."""

    def __init__(self) -> None:
        self.released = []
        self.release_kv = self

    def remote(self, lease: str) -> None:
        self.released.append(lease)


def test_direct_fetch_awaits_the_list_then_gets_the_rdt_ref_on_a_thread_then_ends_the_lease(monkeypatch):
    calls, owner = [], Owner()

    def get(ref, timeout):  # ray.get: an RDT ref cannot be awaited, so it must run off the event loop
        calls.append((ref, timeout, threading.current_thread() is threading.main_thread(), list(owner.released)))
        return "the DeviceKV"

    monkeypatch.setattr(kv_transport.ray, "get", get)

    async def fetch():
        return await DirectTransport(timeout_s=7.0).fetch([resolved(["rdt-ref", owner, "lease-1"])])

    assert asyncio.run(fetch()) == "the DeviceKV"
    assert calls == [("rdt-ref", 7.0, False, [])] and owner.released == ["lease-1"]  # after the read, not before


def test_a_failed_fetch_ends_the_lease_too(monkeypatch):
    owner = Owner()

    def get(ref, timeout):
        raise TimeoutError("the owner is unreachable")

    monkeypatch.setattr(kv_transport.ray, "get", get)

    async def fetch():
        return await DirectTransport().fetch([resolved(["rdt-ref", owner, "lease-2"])])

    with pytest.raises(TimeoutError, match="unreachable"):
        asyncio.run(fetch())
    assert owner.released == ["lease-2"]


def test_leases_hold_refs_until_released_or_run_out():
    now = [100.0]
    leases = KVLeases(lease_s=5.0, clock=lambda: now[0])
    leases.hold("a", "ref a")
    now[0] = 103.0
    leases.hold("b", "ref b")
    assert len(leases) == 2
    leases.release("a")
    leases.release("a")  # twice, or after the lease ran out: nothing more happens
    assert len(leases) == 1
    now[0] = 107.9
    assert leases.expire() == 0 and len(leases) == 1
    now[0] = 108.0
    assert leases.expire() == 1 and len(leases) == 0


def test_a_release_that_overtakes_its_hold_cancels_it():
    """The router may release a lease (its client left at once) before the prefill worker has put
    the KV under it: the hold that follows keeps nothing."""
    now = [0.0]
    leases = KVLeases(lease_s=5.0, clock=lambda: now[0])
    leases.release("early")
    leases.hold("early", "ref")
    assert len(leases) == 0
    leases.hold("early", "ref")  # the key is spent: a second hold under it is a new lease
    assert len(leases) == 1
    leases.release("early")
    leases.release("late")
    now[0] = 5.0
    leases.hold("late", "ref")  # an early release is forgotten after a lease's length
    assert len(leases) == 1


def test_direct_fetch_of_something_else_fails():
    """A prefill worker that yielded a KVPayload (not `[ref, owner, lease]`): an error, which the decode worker
    reports as lost KV, so the prompt is recomputed."""
    async def fetch():
        return await DirectTransport().fetch([resolved({"not": "a list of one ref", "x": 1})])

    with pytest.raises(ValueError):
        asyncio.run(fetch())
