"""Runs one request's two phases: prefill on a prefill worker, then decode on a decode worker.

The first token is yielded as soon as the prefill's metadata arrives, while the KV object is still
on its way. The KV reference is owned here; it reaches the decode worker as an opaque handle of the
KV transport in a short `admit` call, so the object is freed once the worker has copied it. The
tokens come back on this router's channel to that worker (`decode_channel.py`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import ray

from router.decode_channel import DecodeChannel, WorkerFailed
from router.worker_pool import WorkerHandle, WorkerPool
from services.kv_transport import KVTransport, ObjectStoreTransport
from services.metrics import METRICS
from services.protocol import DecodeRequest, PrefillRequest, TokenDelta
from services.sampling_params import SamplingParams


class Orchestrator:
    def __init__(self, pool: WorkerPool, mode: str, transport: KVTransport | None = None) -> None:
        assert mode in ("disaggregated", "colocated")
        self.pool = pool
        self.mode = mode
        self.transport = transport or ObjectStoreTransport()
        self.router_id = uuid.uuid4().hex
        self.channels: dict[str, DecodeChannel] = {}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenDelta]:
        """Token deltas of one request; closing the iterator early aborts it everywhere."""
        request = DecodeRequest(request_id, prompt_token_ids, params)
        if self.mode == "colocated":
            with self.pool.claim("decode", 1) as worker:
                async for delta in self._decode(worker, request, None):
                    yield delta
            return
        with self.pool.claim("prefill", len(prompt_token_ids)) as worker:
            prefill = worker.actor.prefill.remote(PrefillRequest(request_id, prompt_token_ids, params))
            # The metadata comes first, while the KV is being stored. `__anext__` has already
            # fetched it into this process, so `ray.get` returns at once (an `await` would add a
            # thread hop to the time to first token).
            meta = ray.get(await prefill.__anext__())
        METRICS.request_prefill_time.observe(meta.prefill_seconds)
        done = meta.finish_reason is not None or params.max_tokens == 1
        yield TokenDelta([meta.first_token_id], [meta.first_logprobs] if params.logprobs is not None else None,
                         meta.finish_reason or ("length" if done else None), meta.num_cached_tokens)
        # Let the first token reach the client before spending the loop on the decode calls.
        await asyncio.sleep(0)
        if done:
            return  # the prefill stream goes out of scope here and its KV object is freed
        request = DecodeRequest(request_id, prompt_token_ids, params, meta.first_token_id, meta.first_logprobs)
        kv = [await prefill.__anext__()]  # a list, so that _decode can let go of the only reference
        del prefill
        with self.pool.claim("decode", 1) as worker:
            async for delta in self._decode(worker, request, kv):
                yield delta

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
                delta = await deltas.get()
                if delta.error is not None:
                    finished = True  # the worker has already dropped it
                    raise WorkerFailed(f"{worker.name}: {delta.error}")
                finished = delta.finish_reason is not None
                yield delta
        finally:
            channel.close(request.request_id)
            if not finished:  # client gone, a stop string, or the stream broke: free the blocks now
                worker.actor.abort.remote(request.request_id)
            METRICS.request_decode_time.observe(time.perf_counter() - start)

    def shutdown(self) -> None:
        for channel in self.channels.values():
            channel.shutdown()
