"""DecodeWorker: a Ray actor on a decode node that owns a paged KV pool and streams tokens.

A request arrives with its prompt's KV (disaggregated mode): the KV is checksummed and copied into
free blocks, and the sequence joins the running batch. Without KV (colocated mode, or a stream
resumed after a worker died) the worker prefills the prompt itself. Each call is a Ray streaming
generator of TokenDelta items; cancelling it aborts the request and frees its blocks.
"""

from __future__ import annotations

import dataclasses
import time

import ray

from services.kv_transport import TRANSPORTS
from services.protocol import DecodeRequest, TokenDelta, WorkerStats
from services.scheduler import SampledToken
from services.worker_runtime import WorkerSpec, start_engine, worker_stats


class DecodeWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.engine = start_engine(spec)
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        self.kv_transfers: list[tuple[float, int]] = []  # (seconds, bytes) since the last drain
        self.transport = TRANSPORTS[spec.kv_transport]()

    async def generate(self, request: DecodeRequest, kv_handle: object | None):
        """Yield TokenDelta items until the request finishes (a Ray streaming generator).

        `kv_handle` comes from the KV transport (disaggregated mode), or is None: prefill here.
        """
        rid = request.request_id
        if kv_handle is None:
            def add(engine):
                engine.add_request(rid, request.prompt_token_ids, request.params)
        else:
            start = time.perf_counter()
            held = [await self.transport.fetch(kv_handle)]
            self.kv_transfers.append((time.perf_counter() - start, held[0].num_bytes))
            first = SampledToken(request.first_token_id, request.first_logprobs)

            def add(engine):  # pop: once the engine has copied the KV nothing here keeps it alive
                engine.add_prefilled(rid, request.prompt_token_ids, first, request.params, held.pop())
        del kv_handle
        stream = self.engine.submit(rid, add)
        finished = False
        try:
            while not finished:
                outs = await stream.next_batch()
                token_ids = [t for o in outs for t in o.new_token_ids]
                logprobs = [lp for o in outs for lp in o.new_logprobs] if outs[0].new_logprobs is not None else None
                finished = outs[-1].finish_reason is not None
                yield TokenDelta(token_ids, logprobs, outs[-1].finish_reason, outs[-1].num_cached_tokens)
        finally:
            if not finished:  # cancelled by the caller (client gone) or failed: free the blocks now
                self.engine.abort(rid)

    def ping(self) -> str:
        return self.spec.worker_id

    def stats(self) -> WorkerStats:
        """Counters, plus the KV transfers seen since the last call (the caller records them)."""
        transfers, self.kv_transfers = tuple(self.kv_transfers), []
        return dataclasses.replace(worker_stats(self.spec, self.engine, self.node_id), kv_transfers=transfers)

    def shutdown(self) -> None:
        self.engine.shutdown()
