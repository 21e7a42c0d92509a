"""Conditional disaggregation: whether a prompt is prefilled on a prefill worker (its KV then handed
to a decode worker) or by the decode worker that will decode it.

`--local-prefill-tokens N`: a prompt of at most N tokens stays on its decode worker (0: never).
`--local-prefill-tokens auto`: decided per request, from what the router measures, by the seconds
of waiting each choice imposes, summed over every request it delays:

    remote = (tokens queued on the prefill worker + the prompt's uncached tokens) / its prefill rate
             + the hop (router -> prefill worker -> metadata back, beyond the prefill itself)
             + the KV hand-off (prompt tokens x KV bytes per token / the measured transfer rate)
    local  = (1 + streams decoding on the decode worker) x prompt tokens / that worker's prefill rate

(every stream in the decode worker's batch waits while it prefills). Queued tokens and streams are
the larger of what this router has in flight there (current) and what the worker last reported
for all routers (a stats poll old). Local when local < remote: an
idle decode worker takes short prompts and prompts the prefill pool would queue; a busy one leaves
them to the prefill pool. The decode worker's prefill rate is the prefill pool's, scaled by the two
workers' matmul ceilings (prefill is compute-bound). Until a rate has been measured (a remote
prefill, then a stats poll) every prompt goes to the prefill pool.
"""

from __future__ import annotations

from router.worker_pool import WorkerHandle, running_average


class PrefillPlacement:
    def __init__(self, max_local_tokens: int | None = 0) -> None:
        """`max_local_tokens`: the static rule's threshold; None: the cost model."""
        self.max_local_tokens = max_local_tokens
        self.hop_seconds: float | None = None
        self.kv_bytes_per_token: float | None = None

    def observe_prefill(self, seconds: float, prefill_seconds: float, kv_bytes: int, prompt_tokens: int) -> None:
        """One remote prefill as the router saw it: `seconds` from the call to its metadata, of which
        the worker spent `prefill_seconds` (queue and compute); its KV was `kv_bytes`."""
        self.hop_seconds = running_average(self.hop_seconds, max(0.0, seconds - prefill_seconds))
        if kv_bytes:  # a one-token request's prefill exports no KV: it says nothing of the KV's size
            self.kv_bytes_per_token = kv_bytes / max(1, prompt_tokens)

    def local(self, prompt_tokens: int, prefill: WorkerHandle | None, cached_tokens: int,
              decode: WorkerHandle | None, kv_bytes_per_second: float | None) -> bool:
        """Prefill this prompt on `decode` rather than on `prefill` (the workers the pool would pick)?"""
        if self.max_local_tokens is not None:
            return prompt_tokens <= self.max_local_tokens
        if prefill is None or decode is None:
            return False  # no prefill worker left is the orchestrator's failover; no decode: nowhere
        rate = prefill.prefill_tokens_per_second
        if not rate or self.hop_seconds is None or not kv_bytes_per_second or self.kv_bytes_per_token is None:
            return False  # (first_token_seconds below is then known too)
        local_rate = rate * decode.peak_flops / prefill.peak_flops if decode.peak_flops and prefill.peak_flops else rate
        remote = (self.first_token_seconds(prompt_tokens - cached_tokens, prefill)
                  + prompt_tokens * self.kv_bytes_per_token / kv_bytes_per_second)
        return (1 + max(decode.outstanding, decode.reported_requests)) * prompt_tokens / local_rate < remote

    def first_token_seconds(self, uncached_tokens: int, prefill: WorkerHandle | None) -> float | None:
        """When a prompt sent to `prefill` now would have its first token back: the tokens queued
        there and its own, at the measured rate, plus the hop. None until both are measured."""
        if prefill is None or not prefill.prefill_tokens_per_second or self.hop_seconds is None:
            return None
        queued = max(prefill.outstanding, prefill.reported_queued_tokens)  # all routers' work, or ours if newer
        return (queued + uncached_tokens) / prefill.prefill_tokens_per_second + self.hop_seconds

