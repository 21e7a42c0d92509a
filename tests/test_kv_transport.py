"""The KV transports' two methods, without Ray: the handle the router sends, and what `fetch` does
with it (the transfers themselves run in tests/test_e2e_rdt.py and tests/test_e2e_disaggregated.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services import kv_transport
from services.kv_transport import TRANSPORTS, DirectTransport, ObjectStoreTransport


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


def test_direct_fetch_awaits_the_list_then_gets_the_rdt_ref_on_a_thread(monkeypatch):
    calls = []

    def get(ref, timeout):  # ray.get: an RDT ref cannot be awaited, so it must run off the event loop
        calls.append((ref, timeout, threading.current_thread() is threading.main_thread()))
        return "the DeviceKV"

    monkeypatch.setattr(kv_transport.ray, "get", get)

    async def fetch():
        return await DirectTransport(timeout_s=7.0).fetch([resolved(["rdt-ref"])])

    assert asyncio.run(fetch()) == "the DeviceKV"
    assert calls == [("rdt-ref", 7.0, False)]


def test_direct_fetch_of_something_else_fails():
    """A prefill worker that yielded a KVPayload (not `[ref]`): an error, which the decode worker
    reports as lost KV, so the prompt is recomputed."""
    async def fetch():
        return await DirectTransport().fetch([resolved({"not": "a list of one ref", "x": 1})])

    with pytest.raises(ValueError):
        asyncio.run(fetch())
