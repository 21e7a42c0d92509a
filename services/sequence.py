"""One request's state inside an engine: its tokens, progress and block table (imports no torch)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from services.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued; holds no blocks
    RUNNING = "running"  # in the batch; holds blocks
    FINISHED = "finished"  # done; its blocks are freed


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token id (stop strings are matched by the caller on text)
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the caller


@dataclass(slots=True)
class Sequence:
    """A request being generated.

    `token_ids` holds prompt + output. `num_computed_tokens` counts tokens whose KV is in the pool;
    the tokens after it are what the next step must feed. A sequence whose KV arrives from another
    worker (`kv_payload`) starts with the prompt computed and its first output token already sampled.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival_order: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # tokens served by the prefix cache at admission (for metrics/tests)
    block_table: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # entry i: prompt token i + 1
    finish_reason: FinishReason | None = None
    kv_payload: object | None = None  # services.kv_payload.KVPayload awaiting import (decode side)
    kv_check: object | None = None  # concurrent.futures.Future: that payload's checksum pass, still running
    export_kv: bool = False  # prefill side: return the prompt's KV when the prompt is done
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still to compute."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
