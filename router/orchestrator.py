"""Runs one request's two phases: prefill on a prefill worker, then decode on a decode worker.

The first token is yielded as soon as the prefill's metadata arrives, while the KV object is still
on its way. The KV reference is owned here; it reaches the decode worker as an opaque handle of the
KV transport in a short `admit` call, so the object is freed once the worker has copied it. The
tokens come back on this router's channel to that worker (`decode_channel.py`).

If a decode worker dies mid-stream, its streams resume on another one: the new worker prefills the
prompt plus every token already delivered and continues from there. Sampling is seeded per position
(the seed is fixed here when the client gave none), so the resumed stream is the one the client
would have seen: no token lost, none repeated. The prefill side degrades the same way: a dead
prefill worker's prefill is retried on the next one, or, with none left, done by a decode worker;
a KV that is lost or fails its checksum is recomputed there from the prompt and the first token.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import ray
from ray.exceptions import RayActorError

from router.decode_channel import ChannelClosed, DecodeChannel, KVLost, WorkerFailed, WorkerLost
from router.prefill_placement import PrefillPlacement
from router.prefix_index import PrefixIndex
from router.worker_pool import WorkerHandle, WorkerPool
from services.kv_transport import KVTransport, ObjectStoreTransport
from services.metrics import METRICS
from services.protocol import DecodeRequest, PrefillRequest, PrefillResult, TokenDelta
from services.sampling_params import SamplingParams

log = logging.getLogger("pdserve.router")


class Orchestrator:
    def __init__(self, pool: WorkerPool, mode: str, transport: KVTransport | None = None,
                 local_prefill_tokens: int | None = 0, block_size: int = 16) -> None:
        """`local_prefill_tokens`: prompts up to this long prefill on their decode worker; None: a
        cost model decides per request (`prefill_placement.py`)."""
        assert mode in ("disaggregated", "colocated")
        self.pool = pool
        self.mode = mode
        self.transport = transport or ObjectStoreTransport()
        self.placement = PrefillPlacement(local_prefill_tokens)  # conditional disaggregation
        self.prefixes = PrefixIndex(block_size)  # prompts go where their prefix is likely cached
        self.router_id = uuid.uuid4().hex
        self.channels: dict[str, DecodeChannel] = {}
        self.max_failovers = 2  # decode workers a stream may lose before it fails

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenDelta]:
        """Token deltas of one request; closing the iterator early aborts it everywhere."""
        if params.seed is None:  # chosen here, so that a resumed stream samples what it would have
            params = replace(params, seed=secrets.randbits(63))
        request = DecodeRequest(request_id, prompt_token_ids, params)
        keys = self.prefixes.keys(prompt_token_ids)
        local = self.mode == "colocated" or self._prefill_locally(len(prompt_token_ids), keys)
        if local and self.mode == "disaggregated":
            METRICS.local_prefills.inc()
        prefilled = None if local else await self._prefill(request, keys)
        if prefilled is None:  # colocated, short, or no prefill worker left: a decode worker prefills
            # Colocated, the decode workers' prefix caches are the ones a prompt may hit: route by them.
            async for delta in self._decode_anywhere(request, None, keys if self.mode == "colocated" else []):
                yield delta
            return
        meta, prefill, owner = prefilled
        del prefilled  # `prefill` must be the stream's only reference: it is dropped once the KV is taken
        METRICS.request_prefill_time.observe(meta.prefill_seconds)
        done = meta.finish_reason is not None or params.max_tokens == 1  # then no KV was exported
        kv, read = [], False  # a list, so that _decode can let go of the only reference to the KV
        lease = meta.kv_lease  # over RDT: `owner` holds the KV until a decode worker reads it, or this is released

        def end_lease() -> None:  # once: a lease the decode worker's read ended already is ended again harmlessly
            nonlocal lease
            if lease is not None:
                owner.release_kv.remote(lease)
                lease = None
        completed = False
        try:
            yield TokenDelta([meta.first_token_id], [meta.first_logprobs] if params.logprobs is not None else None,
                             meta.finish_reason or ("length" if done else None), meta.num_cached_tokens,
                             prompt_logprobs=meta.prompt_logprobs)
            # Let the first token reach the client before spending the loop on the decode calls.
            await asyncio.sleep(0)
            if done:
                return
            request = DecodeRequest(request_id, prompt_token_ids, params, meta.first_token_id, meta.first_logprobs)
            try:
                kv.append(await prefill.__anext__())
                read = True
            except RayActorError as error:  # the worker died before handing over the KV: recompute it
                log.warning("prefill of %s lost its KV: %s", request_id, error)
                METRICS.kv_recomputes.inc()
                lease, request = None, _resumed(request, [meta.first_token_id])
            del prefill
            async for delta in self._decode_anywhere(request, kv or None, kv_unread=end_lease):
                yield delta
            completed = True
        finally:
            # never handed to a decode worker (the client left, or none could take it: 503), or the decode failed or
            # was left after admit, perhaps before the worker read the KV (a lease its read ended is ended again)
            if kv or not read or not completed:
                end_lease()
            kv.clear()  # now, not when the frames an error's traceback holds are collected

    def _prefill_locally(self, prompt_tokens: int, keys: list) -> bool:
        cached = self.prefixes.cached_tokens(keys)
        prefill = self.pool.best("prefill", cached)
        return self.placement.local(prompt_tokens, prefill, cached.get(prefill.name, 0) if prefill else 0,
                                    self.pool.best("decode"), self.pool.kv_bytes_per_second)

    async def _prefill(self, request: DecodeRequest, keys: list) -> tuple[PrefillResult, object, object] | None:
        """The prefill's metadata, its call's stream (whose next item is the KV) and its worker, from the least
        loaded prefill worker; one that dies is marked so and the next one tried. None when no
        prefill worker is left (the caller lets a decode worker prefill)."""
        for _ in range(self.max_failovers + 1):
            if not self.pool.role("prefill"):
                break
            cached = self.prefixes.cached_tokens(keys)
            with self.pool.claim("prefill", len(request.prompt_token_ids), cached) as worker:
                self.prefixes.record(keys, worker.name)
                prefill = worker.actor.prefill.remote(PrefillRequest(request.request_id, request.prompt_token_ids,
                                                                     request.params))
                try:
                    # `__anext__` has already fetched the metadata into this process, so `ray.get`
                    # returns at once (an `await` would add a thread hop to the time to first token).
                    sent = time.perf_counter()
                    meta: PrefillResult = ray.get(await prefill.__anext__())
                    self.placement.observe_prefill(time.perf_counter() - sent, meta.prefill_seconds, meta.kv_bytes,
                                                   len(request.prompt_token_ids))
                    return meta, prefill, worker.actor
                except RayActorError as error:
                    worker.alive = False  # until a stats poll finds it answering again
                    log.warning("prefill of %s failed on %s: %s", request.request_id, worker.name, error)
                    METRICS.prefill_failovers.inc()
        return None

    async def _decode_anywhere(self, request: DecodeRequest, kv: list | None, keys: list = (),
                               kv_unread: Callable[[], None] | None = None) -> AsyncIterator[TokenDelta]:
        """Decode on the least loaded worker; if it dies, resume on another (up to max_failovers).
        If the KV cannot be used there (lost with its node, or corrupt), recompute the prompt. The
        caller drops `kv` if no worker took it; `kv_unread` is called when the worker it was handed to
        failed, perhaps before reading it (the KV's holder need not keep it any longer).
        `keys` (the prompt's prefix keys, when the decode worker prefills it): of equally loaded
        workers, the one that likely holds the prefix is chosen, and it is recorded as holding it."""
        delivered = [] if request.first_token_id is None else [request.first_token_id]
        for attempt in range(self.max_failovers + 1):
            with self.pool.claim("decode", 1, self.prefixes.cached_tokens(keys)) as worker:
                self.prefixes.record(keys, worker.name)
                try:
                    async for delta in self._decode(worker, request, kv):
                        delivered += delta.token_ids
                        yield delta
                    return
                except (WorkerLost, KVLost) as error:
                    if kv is not None and kv_unread is not None:
                        kv_unread()
                    if isinstance(error, WorkerLost) and not isinstance(error, ChannelClosed):
                        worker.alive = False  # until a stats poll finds it answering again
                    if attempt == self.max_failovers:
                        raise
                    log.warning("resuming %s after %d tokens: %s", request.request_id, len(delivered), error)
                    (METRICS.kv_recomputes if isinstance(error, KVLost) else METRICS.decode_failovers).inc()
            kv = None
            request = _resumed(request, delivered)

    async def _decode(self, worker: WorkerHandle, request: DecodeRequest, kv: list | None
                      ) -> AsyncIterator[TokenDelta]:
        """Admit `request` on `worker` (with the KV reference in `kv`, which is emptied so that
        the admit call alone holds it) and yield its deltas from this router's channel."""
        start = time.perf_counter()
        channel = self.channels.get(worker.name)
        if channel is None:
            channel = self.channels[worker.name] = DecodeChannel(worker.name, worker.actor, self.router_id)
        deltas = channel.open(request.request_id)
        handle = None if kv is None else self.transport.handle(kv.pop())
        worker.actor.admit.remote(request, handle, channel.channel_id)
        del handle
        finished = False
        try:
            while not finished:
                try:
                    delta = await deltas.get()
                except WorkerLost:
                    finished = True  # nothing is left there to abort
                    raise
                if delta.error is not None:
                    finished = True  # the worker has already dropped it
                    raise (KVLost if delta.kv_lost else WorkerFailed)(f"{worker.name}: {delta.error}")
                finished = delta.finish_reason is not None
                yield delta
        finally:
            channel.close(request.request_id)
            if not finished:  # client gone, a stop string, or the stream broke: free the blocks now
                worker.actor.abort.remote(request.request_id)
            METRICS.request_decode_time.observe(time.perf_counter() - start)

    async def renew_channels(self, timeout: float = 2.0) -> None:
        """Tell every decode worker with a channel from this router that the router is alive (a
        worker drops channels whose lease runs out, and aborts their requests)."""
        calls = [channel.actor.renew.remote([channel.channel_id]) for channel in self.channels.values()]
        await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout)

    def forget(self, worker_name: str) -> None:
        """Drop this router's channel to a worker that was removed (or replaced under its name)."""
        channel = self.channels.pop(worker_name, None)
        if channel is not None:
            channel.fail_open("the worker was removed")
            channel.shutdown()

    def first_token_estimate(self, prompt_token_ids: list[int]) -> float | None:
        """Seconds until this prompt, sent now, would have its first token from the prefill pool;
        None where it would not go there (colocated, or prefilled by its decode worker) or where the
        router has not measured the pool yet."""
        if self.mode != "disaggregated":
            return None
        keys = self.prefixes.keys(prompt_token_ids)
        if self._prefill_locally(len(prompt_token_ids), keys):
            return None
        cached = self.prefixes.cached_tokens(keys)
        prefill = self.pool.best("prefill", cached)
        if prefill is None:
            return None
        return self.placement.first_token_seconds(len(prompt_token_ids) - cached.get(prefill.name, 0), prefill)

    def shutdown(self) -> None:
        for channel in self.channels.values():
            channel.shutdown()


def _resumed(request: DecodeRequest, delivered: list[int]) -> DecodeRequest:
    """`request` restarted without KV: a decode worker prefills the prompt plus the tokens the client
    already has (`delivered`) and continues after them.

    The restart gets a request id of its own: it may land on the worker that still runs the old
    attempt (a channel the worker closed), and a step of the old sequence finishing after the
    new one registered the same id would hand the new stream a token twice."""
    attempt = f"{request.request_id.split('/resume-')[0]}/resume-{uuid.uuid4().hex[:8]}"
    # The prompt's logprobs went out with the first token; the resumed prefill does not redo them.
    return DecodeRequest(attempt, request.prompt_token_ids, replace(request.params, prompt_logprobs=None),
                         output_token_ids=list(delivered))
