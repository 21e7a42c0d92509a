"""Messages between the router and the workers (imports no torch).

The KV itself travels separately, as its own Ray object (`services.kv_payload.KVPayload`), so the
router owns its reference and can free it the moment the decode side has copied it.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.sampling_params import SamplingParams


@dataclass(frozen=True)
class PrefillRequest:
    """Compute the prompt's KV and sample the first token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class PrefillResult:
    """The small half of a prefill's two returns (the other is the KV: a KVPayload, or over RDT
    `[ref, the prefill worker, kv_lease]` of a DeviceKV)."""

    request_id: str
    first_token_id: int
    first_logprobs: dict[int, float] | None
    finish_reason: str | None  # "stop" when the first token already ends the request, else None
    num_cached_tokens: int  # prompt tokens served by the prefill worker's prefix cache
    prefill_seconds: float  # on the worker, from arrival (queueing included) to the first token
    kv_bytes: int
    worker_id: str
    prompt_logprobs: list[dict[int, float]] | None = None  # when asked for: entry i is prompt token i + 1
    kv_lease: str | None = None  # over RDT: the worker holds the KV until this lease is released


@dataclass(frozen=True)
class DecodeRequest:
    """Continue a request on a decode worker. With a KV payload, the prompt is already computed and
    `first_token_id` sampled; without one (colocated mode, or a resumed stream) the worker prefills
    `prompt_token_ids` itself and `first_token_id` is None. A stream resumed after its decode worker
    died also carries the tokens it has already delivered (`output_token_ids`): they are prefilled
    with the prompt, and only new tokens come back."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_id: int | None = None
    first_logprobs: dict[int, float] | None = None
    output_token_ids: list[int] = ()


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request (several when the reader lagged behind the engine). `error` ends
    the request with a failure (a KV that failed its checksum, an engine fault); `kv_lost` says the
    failure was the prompt's KV (not fetched, or not verified), so the prompt can be recomputed."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_lost: bool = False
    prompt_logprobs: list[dict[int, float]] | None = None  # with a request's first delta, when asked for

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @staticmethod
    def merge(deltas: list[TokenDelta]) -> TokenDelta:
        """Consecutive deltas of one request as one (how a lagging reader catches up)."""
        if len(deltas) == 1:
            return deltas[0]
        last = deltas[-1]
        logprobs = None if deltas[0].logprobs is None else [lp for d in deltas for lp in d.logprobs or ()]
        failed = next((d for d in deltas if d.error is not None), None)
        prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        return TokenDelta([t for d in deltas for t in d.token_ids], logprobs, last.finish_reason,
                          last.num_cached_tokens, failed and failed.error, failed is not None and failed.kv_lost,
                          prompt)


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    role: str  # "prefill" | "decode"
    node_id: str
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_tokens_processed: int
    num_prefix_queries: int
    num_prefix_hits: int
    num_steps: int
    num_queued_tokens: int = 0  # tokens its running and waiting requests have yet to compute (all routers')
    draining: bool = False  # being removed (`pdserve scale`): routers send it nothing new
    device: str = "cpu"  # where its engine runs ("cuda:0"): a GPU node's worker that shows "cpu" was given no GPU
    quantization: str | None = None  # its weights' format (None: the compute dtype)
    kernels: str = ""  # the kernels chosen on its host, one line (services/kernels/kernel_plan.py)
    kv_transfers: tuple[tuple[float, int], ...] = ()  # (seconds, bytes) of KV fetched since the last call
    kv_transfer_failures: int = 0
    queue_times: tuple[float, ...] = ()  # seconds prompts waited for their first step, since the last call
    # Running totals for the efficiency gauges (services/roofline.py): work done and busy seconds
    # per phase, and this worker's ceilings.
    prefill_flops: int = 0
    prefill_seconds: float = 0.0
    decode_bytes: int = 0
    decode_seconds: float = 0.0
    peak_flops: float = 0.0
    peak_bytes_per_second: float = 0.0
