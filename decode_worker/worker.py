"""DecodeWorker: a Ray actor on a decode node that owns a paged KV pool and streams tokens.

A router opens one `channel` per decode worker: a Ray streaming generator whose items carry the
new tokens of all that router's requests (see `output_channel.py` for why not one stream per
request). `admit` starts a request on a channel: with its prompt's KV (fetched, checksummed and
copied into free blocks) or, without one (colocated mode, or a stream resumed after a worker
died), prefilling the prompt here. `abort` stops one request; a closed channel aborts all of its.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

from decode_worker.output_channel import OutputChannel
from services.errors import KVTransferError
from services.kv_payload import KVPayload
from services.kv_transport import TRANSPORTS
from services.protocol import DecodeRequest, WorkerStats
from services.sample_log import SampleLog
from services.scheduler import SampledToken
from services.worker_runtime import WorkerActor, WorkerSpec


class DecodeWorker(WorkerActor):
    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.kv_transfers = SampleLog()  # (seconds, bytes) of each KV fetched
        self.transport = TRANSPORTS[spec.kv_transport]()
        self.kv_fetch_failures = 0  # counted on the event loop
        self.kv_check_failures = 0  # counted on the checker thread (one writer each: no lock)
        # Checksum passes run here while the engine thread copies the same KV into its blocks
        # (xxhash releases the GIL): the hand-off costs the longer of the two, not their sum.
        self._kv_checker = ThreadPoolExecutor(1, thread_name_prefix="kv-check")
        self._channels: dict[str, OutputChannel] = {}
        self._fetching: set[str] = set()  # requests whose KV is on its way
        self._aborted: set[str] = set()  # ...and were aborted meanwhile
        # A router renews its channels every second or so (`renew`); one silent for this long is
        # gone (its process died: Ray does not stop an actor's stream when its caller dies), and
        # the requests it had here are aborted rather than left to run to max_tokens.
        self.channel_lease = 10.0
        # Test-only fault injection: "corrupt" (flip one bit) or "lose" (fail the fetch) the next
        # KV fetched here (a KVPayload or a DeviceKV), so that tests drive the real prefill -> admit -> recompute path;
        # "die": the process exits where it would fetch the next KV (a worker lost between admit and its read);
        # "fail": admit fails there with another error (the request fails, the KV unread).
        self.kv_fault: str | None = None
        # Test-only: requests this worker reports waiting on top of its own (the routers' cost model
        # reads them through the real stats path).
        self.simulated_requests = 0

    async def channel(self, channel_id: str):
        """Yield lists of (request_id, TokenDelta), one per request that advanced, until cancelled
        or its lease runs out (a Ray streaming generator). When it ends, the router's requests still
        running here stop."""
        channel = self._channels.get(channel_id)
        if channel is None or channel.attached:  # a router re-opening its channel gets a fresh one
            channel = self._open(channel_id)
        channel.attached = True
        try:
            while (item := await channel.next_item()) is not None:
                yield item
        finally:
            self._close(channel_id, channel)

    def renew(self, channel_ids: list[str]) -> None:
        """The router that owns these channels is alive: extend their leases."""
        now = time.monotonic()
        for channel_id in channel_ids:
            if channel_id in self._channels:
                self._channels[channel_id].renewed = now

    async def admit(self, request: DecodeRequest, kv_handle: object | None, channel_id: str) -> None:
        """Start `request`, its tokens going to channel `channel_id`; failures go there too.

        With `kv_handle` the prompt was prefilled elsewhere: its KV is fetched and verified here.
        A separate, short call on purpose: Ray keeps a call's arguments alive until the call returns,
        so the KV object is freed once it is copied, not when the request ends.
        """
        rid = request.request_id
        channel = self._channels.get(channel_id) or self._open(channel_id)  # admit may come first
        channel.renewed = time.monotonic()
        channel.add(rid)
        try:
            if kv_handle is None:
                self.engine.submit(rid, lambda e: e.add_request(rid, request.prompt_token_ids, request.params,
                                                                output_token_ids=request.output_token_ids),
                                   channel)
                return
            if self.kv_fault == "fail":
                self.kv_fault = None
                raise RuntimeError("test fault: admit failed before the fetch")
            held = [await self._fetch(rid, kv_handle)]
            if rid in self._aborted:
                self._aborted.discard(rid)
                channel.request_ids.discard(rid)
                return
            first = SampledToken(request.first_token_id, request.first_logprobs)
            check = self._kv_checker.submit(self._verify, held[0])

            def add(engine):  # pop: once the engine has copied the KV nothing here keeps it alive
                engine.add_prefilled(rid, request.prompt_token_ids, first, request.params, held.pop(),
                                     kv_check=check)

            self.engine.submit(rid, add, channel)
        except Exception as error:
            channel.fail_here(rid, error)

    async def _fetch(self, request_id: str, kv_handle: object):
        self._fetching.add(request_id)
        try:
            start = time.perf_counter()
            fault, self.kv_fault = self.kv_fault, None
            if fault == "die":
                os._exit(1)
            kv = await self.transport.fetch(kv_handle)
            if fault == "lose":  # after the fetch, which ends the prefill worker's lease on it
                raise LookupError("test fault: the KV object was lost")
            if fault == "corrupt":
                kv = _corrupted(kv)
            self.kv_transfers.extend([(time.perf_counter() - start, kv.num_bytes)])
            return kv
        except Exception as error:  # e.g. the object died with the prefill node that held it
            self.kv_fetch_failures += 1
            raise KVTransferError(f"the KV could not be fetched: {type(error).__name__}: {error}") from error
        finally:
            self._fetching.discard(request_id)

    def _verify(self, kv) -> None:
        try:
            self.engine.engine.verify_kv(kv)
        except Exception:
            self.kv_check_failures += 1
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (the client went away, or a stop string matched)."""
        if request_id in self._fetching:
            self._aborted.add(request_id)
        self.engine.abort(request_id)
        for channel in self._channels.values():
            channel.request_ids.discard(request_id)

    def _open(self, channel_id: str) -> OutputChannel:
        loop = asyncio.get_running_loop()
        channel = self._channels[channel_id] = OutputChannel(loop)
        loop.call_later(self.channel_lease, self._check_lease, channel_id, channel)
        return channel

    def _check_lease(self, channel_id: str, channel: OutputChannel) -> None:
        if channel.closed:
            return
        left = channel.renewed + self.channel_lease - time.monotonic()
        if left > 0:
            channel.loop.call_later(left, self._check_lease, channel_id, channel)
        else:
            self._close(channel_id, channel)

    def _close(self, channel_id: str, channel: OutputChannel) -> None:
        channel.close()
        if self._channels.get(channel_id) is channel:
            del self._channels[channel_id]
        for rid in list(channel.request_ids):
            self.abort(rid)

    def stats(self, reader: str = "") -> WorkerStats:
        """Counters, and the samples (KV transfers, queue times) `reader` (a router's id) has not had yet."""
        failures = self.kv_fetch_failures + self.kv_check_failures
        stats = super().stats(reader)
        return dataclasses.replace(stats, kv_transfers=self.kv_transfers.take(reader), kv_transfer_failures=failures,
                                   num_waiting=stats.num_waiting + self.simulated_requests)

    def shutdown(self) -> None:
        super().shutdown()
        self._kv_checker.shutdown(wait=False)


def _corrupted(kv):
    """A copy of the fetched `kv` (KVPayload or DeviceKV) with one bit flipped and the sender's
    checksum kept: what a bad transfer would deliver (test-only fault)."""
    if isinstance(kv, KVPayload):
        first = kv.slices[0]
        data = first.data.copy()
        data.reshape(-1).view("uint8")[0] ^= 1
        return dataclasses.replace(kv, slices=(dataclasses.replace(first, data=data), *kv.slices[1:]))
    import torch  # a DeviceKV came over RDT: this worker's engine has loaded torch already

    data = kv.kv.clone()
    data.reshape(-1).view(torch.uint8)[0] ^= 1
    return dataclasses.replace(kv, kv=data)
