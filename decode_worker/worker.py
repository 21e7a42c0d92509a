"""DecodeWorker: a Ray actor on a decode node that owns a paged KV pool and streams tokens.

A prefilled request is admitted with its prompt's KV (`admit`): the KV is fetched, checksummed and
copied into free blocks, and the sequence joins the running batch. Without KV (colocated mode, or
a stream resumed after a worker died) the worker prefills the prompt itself. `generate` is a Ray
streaming generator of TokenDelta items; cancelling it aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
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
        self.kv_transfer_failures = 0
        self._admissions: dict[str, asyncio.Future] = {}
        self.admission_timeout = 60.0

    async def admit(self, request: DecodeRequest, kv_handle: object) -> None:
        """Fetch a prefilled request's KV and queue it for the engine; `generate` streams it.

        A separate, short call on purpose: Ray keeps a call's arguments alive until the call
        returns, so the KV object can be freed here, not only when the whole stream ends.
        """
        rid = request.request_id
        admission = self._admission(rid)
        try:
            start = time.perf_counter()
            held = [await self.transport.fetch(kv_handle)]
            self.kv_transfers.append((time.perf_counter() - start, held[0].num_bytes))
            # The checksum pass runs in a thread: neither this event loop nor the step loop waits.
            await asyncio.to_thread(self.engine.engine.verify_kv, held[0])
            first = SampledToken(request.first_token_id, request.first_logprobs)

            def add(engine):  # pop: once the engine has copied the KV nothing here keeps it alive
                engine.add_prefilled(rid, request.prompt_token_ids, first, request.params, held.pop(),
                                     verified=True)

            admission.set_result(self.engine.submit(rid, add))
        except Exception as error:
            self.kv_transfer_failures += 1
            admission.set_exception(error)
            raise
        # A router that died between admit and generate must not leave the request running.
        asyncio.get_running_loop().call_later(self.admission_timeout, self._expire, rid)

    async def generate(self, request: DecodeRequest):
        """Yield TokenDelta items until the request finishes (a Ray streaming generator).

        A request with `first_token_id` was (or is being) admitted with its KV; one without is
        prefilled here (colocated mode).
        """
        rid = request.request_id
        if request.first_token_id is None:
            stream = self.engine.submit(
                rid, lambda engine: engine.add_request(rid, request.prompt_token_ids, request.params))
        else:
            stream = await self._admission(rid)
            del self._admissions[rid]
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

    def _admission(self, request_id: str) -> asyncio.Future:
        """The future of a request's stream, shared by `admit` and `generate` (either may run first)."""
        if request_id not in self._admissions:
            self._admissions[request_id] = asyncio.get_running_loop().create_future()
        return self._admissions[request_id]

    def _expire(self, request_id: str) -> None:
        if request_id in self._admissions:  # generate never came for it
            self._admissions.pop(request_id)
            self.engine.abort(request_id)

    def ping(self) -> str:
        return self.spec.worker_id

    def stats(self) -> WorkerStats:
        """Counters, plus the KV transfers seen since the last call (the caller records them)."""
        transfers, self.kv_transfers = tuple(self.kv_transfers), []
        return dataclasses.replace(worker_stats(self.spec, self.engine, self.node_id), kv_transfers=transfers,
                                   kv_transfer_failures=self.kv_transfer_failures)

    def shutdown(self) -> None:
        self.engine.shutdown()
