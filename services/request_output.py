"""What an engine reports back: per-step deltas and finished requests (imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kv_payload import KVPayload


@dataclass(slots=True)
class StepOutput:
    """New tokens of one request from one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    kv: KVPayload | None = None  # the prompt's KV, for requests added with export_kv=True
    error: BaseException | None = None  # the request failed (its imported KV did not verify); no tokens
    prompt_logprobs: list[dict[int, float]] | None = None  # with the first output, when asked for


@dataclass(slots=True)
class RequestOutput:
    """A finished request from `Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    kv: KVPayload | None = field(default=None, repr=False)
    prompt_logprobs: list[dict[int, float]] | None = None  # entry i: prompt token i + 1
