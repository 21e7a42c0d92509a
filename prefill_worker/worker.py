"""PrefillWorker: a Ray actor on a prefill node that computes prompts' KV and first tokens.

Prompts that arrive while the engine is busy are batched into the next forward pass by the
engine's scheduler. Each call is a two-item Ray streaming generator: first the small metadata
(first token, logprob, timing), then the KV. Both are return values, so the caller owns both
references and nothing is orphaned if this actor dies; and the metadata reaches the router
without waiting for the KV to be written into the object store (26 ms for 96 MiB here).

With the KV over Ray Direct Transport (`spec.kv_transport == "rdt"`) the engine exports a
`DeviceKV` (no host copy) and the second item is `[ref, this actor, lease]`, the ref put here under
the spec's tensor transport: this actor owns the tensors and holds its own ref until the decode
worker has read them or the lease runs out (`services/kv_transport.py`: `DirectTransport`, `KVLeases`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import ray

from services.kv_payload import KVPayload
from services.kv_transport import KVLeases
from services.protocol import PrefillRequest, PrefillResult, WorkerStats
from services.worker_runtime import WorkerActor, WorkerSpec


class PrefillWorker(WorkerActor):
    # Test-only: prompt tokens this worker reports queued on top of its own, so that tests load the
    # routers' view of it through the real stats path (a queue no test could build for real).
    simulated_queued_tokens = 0

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        if spec.kv_transport == "rdt":  # a tensor-parallel group exports host slices: the launcher refuses it
            assert spec.tensor_parallel_size == 1 and spec.tensor_transport is not None
            self.engine.engine.runner.export_on_device = True
            self.kv_leases, self.handle = KVLeases(), ray.get_runtime_context().current_actor

    def release_kv(self, lease: str) -> None:
        """The decode worker has read (or given up on) the KV under `lease`: let go of it."""
        self.kv_leases.release(lease)

    def stats(self, reader: str = "") -> WorkerStats:
        if self.spec.kv_transport == "rdt":
            self.kv_leases.expire()  # the router polls stats: a lease no reader ended runs out here
        stats = super().stats(reader)
        return dataclasses.replace(stats, num_queued_tokens=stats.num_queued_tokens + self.simulated_queued_tokens)

    async def prefill(self, request: PrefillRequest) -> AsyncIterator[PrefillResult | KVPayload | list]:
        """Prefill the prompt; yields the PrefillResult, then (unless max_tokens is 1 or the first
        token ended the request: nobody would read it) the KV: a KVPayload, or over RDT `[ref, this
        actor, lease]`, the DeviceKV put by this actor (its owner), which holds it until released."""
        # Only the first token is sampled here; min_tokens keeps masking EOS for it if asked.
        params = dataclasses.replace(request.params, max_tokens=1, min_tokens=min(request.params.min_tokens, 1))
        # A one-token request (a scored prompt among them: max_tokens 0 with echo) ends here, so its
        # KV would go nowhere: none is exported, and this stream has one item.
        export_kv = request.params.max_tokens > 1
        arrived = time.perf_counter()
        stream = self.engine.submit(
            request.request_id,
            lambda engine: engine.add_request(request.request_id, request.prompt_token_ids, params,
                                              export_kv=export_kv))
        try:
            (out,) = await stream.next_batch()
        except BaseException:
            self.engine.abort(request.request_id)
            raise
        done = time.perf_counter()
        assert (out.kv is not None) == export_kv and out.finish_reason is not None
        hand_over = export_kv and out.finish_reason != "stop"  # the router reads no KV after a stop
        lease = uuid.uuid4().hex if hand_over and self.spec.kv_transport == "rdt" else None
        result = PrefillResult(
            request_id=request.request_id,
            first_token_id=out.new_token_ids[0],
            first_logprobs=out.new_logprobs[0] if out.new_logprobs else None,
            prompt_logprobs=out.prompt_logprobs,
            finish_reason="stop" if out.finish_reason == "stop" else None,
            num_cached_tokens=out.num_cached_tokens,
            prefill_seconds=done - arrived,
            kv_bytes=out.kv.num_bytes if export_kv else 0,
            worker_id=self.spec.worker_id,
            kv_lease=lease,
        )
        yield result
        if not hand_over:
            return
        if lease is not None:
            ref = ray.put(out.kv, _tensor_transport=self.spec.tensor_transport)
            self.kv_leases.hold(lease, ref)
            yield [ref, self.handle, lease]
        else:
            yield out.kv
