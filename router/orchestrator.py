"""Runs one request's two phases: prefill on a prefill worker, then decode on a decode worker.

The first token is yielded as soon as the prefill's metadata arrives, while the KV object is still
on its way. The KV reference is owned here; it reaches the decode worker as an opaque handle of the
KV transport in a short `admit` call, so the object is freed once the worker has copied it, while
`generate` streams the tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import ray

from router.worker_pool import WorkerPool
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

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenDelta]:
        """Token deltas of one request; closing the iterator early aborts it everywhere."""
        request = DecodeRequest(request_id, prompt_token_ids, params)
        if self.mode == "colocated":
            with self.pool.claim("decode", 1) as worker:
                async for delta in self._decode(worker.actor, request):
                    yield delta
            return
        with self.pool.claim("prefill", len(prompt_token_ids)) as worker:
            prefill = worker.actor.prefill.remote(PrefillRequest(request_id, prompt_token_ids, params))
            meta = await (await prefill.__anext__())  # metadata first, while the KV is being stored
        METRICS.request_prefill_time.observe(meta.prefill_seconds)
        done = meta.finish_reason is not None or params.max_tokens == 1
        yield TokenDelta([meta.first_token_id], [meta.first_logprobs] if params.logprobs is not None else None,
                         meta.finish_reason or ("length" if done else None), meta.num_cached_tokens)
        # Let the first token reach the client before spending the loop on the decode calls.
        await asyncio.sleep(0)
        if done:
            return  # the prefill stream goes out of scope here and its KV object is freed
        request = DecodeRequest(request_id, prompt_token_ids, params, meta.first_token_id, meta.first_logprobs)
        kv_ref = await prefill.__anext__()
        del prefill
        with self.pool.claim("decode", 1) as worker:
            # admit (fetch + copy the KV) and generate are sent back to back; the worker pairs them.
            worker.actor.admit.remote(request, self.transport.handle(kv_ref))
            del kv_ref  # the admit call holds the KV until the worker has copied it
            async for delta in self._decode(worker.actor, request):
                yield delta

    async def _decode(self, actor, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        start = time.perf_counter()
        stream = actor.generate.remote(request)
        finished = False
        try:
            async for ref in stream:
                delta: TokenDelta = await ref
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:  # client gone or an error: stop the worker's generator, free its blocks
                ray.cancel(stream)
            METRICS.request_decode_time.observe(time.perf_counter() - start)
