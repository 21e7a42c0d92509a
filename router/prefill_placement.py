"""Conditional disaggregation: whether a prompt is prefilled on a prefill worker (its KV then handed
to a decode worker) or by the decode worker that will decode it.

`--local-prefill-tokens N`: a prompt of at most N tokens stays on its decode worker (0: never).
`--local-prefill-tokens auto`: decided per request, from what the router measures, by the seconds
of waiting each choice imposes, summed over every request it delays:

    remote = (tokens queued on the prefill worker + the prompt's uncached tokens) / its prefill rate
             + the hop (router -> prefill worker -> metadata back, beyond the prefill itself)
             + the KV hand-off (prompt tokens x KV bytes per token / the measured transfer rate)
    local  = (1 + streams decoding on the decode worker) x prompt tokens / that worker's prefill rate

(every stream in the decode worker's batch waits while it prefills). Local when local < remote: an
idle decode worker takes short prompts and prompts the prefill pool would queue; a busy one leaves
them to the prefill pool. The decode worker's prefill rate is the prefill pool's, scaled by the two
workers' matmul ceilings (prefill is compute-bound). Until a rate has been measured (a remote
prefill, then a stats poll) every prompt goes to the prefill pool.
"""

from __future__ import annotations

from router.worker_pool import WorkerHandle

_SMOOTHING = 0.2  # weight of the newest sample in the running averages


class PrefillPlacement:
    def __init__(self, max_local_tokens: int | None = 0) -> None:
        """`max_local_tokens`: the static rule's threshold; None: the cost model."""
        self.max_local_tokens = max_local_tokens
        self.hop_seconds: float | None = None
        self.kv_bytes_per_token: float | None = None

    def observe_prefill(self, seconds: float, prefill_seconds: float, kv_bytes: int, prompt_tokens: int) -> None:
        """One remote prefill as the router saw it: `seconds` from the call to its metadata, of which
        the worker spent `prefill_seconds` (queue and compute); its KV was `kv_bytes`."""
        hop = max(0.0, seconds - prefill_seconds)
        self.hop_seconds = hop if self.hop_seconds is None else _average(self.hop_seconds, hop)
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
        return (1 + decode.outstanding) * prompt_tokens / local_rate < remote

    def first_token_seconds(self, uncached_tokens: int, prefill: WorkerHandle | None) -> float | None:
        """When a prompt sent to `prefill` now would have its first token back: the tokens queued
        there and its own, at the measured rate, plus the hop. None until both are measured."""
        if prefill is None or not prefill.prefill_tokens_per_second or self.hop_seconds is None:
            return None
        return (prefill.outstanding + uncached_tokens) / prefill.prefill_tokens_per_second + self.hop_seconds


def _average(old: float, new: float) -> float:
    return (1 - _SMOOTHING) * old + _SMOOTHING * new
