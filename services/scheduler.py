"""Continuous batching: what runs each step, under a token budget and the free KV blocks (no torch).

Every step feeds each scheduled sequence a chunk of its uncomputed tokens: one token for a sequence
that is decoding, up to the remaining budget for a prompt (chunked prefill). Running sequences go
first, in admission order; when blocks run out, the most recently admitted sequence is preempted
(its blocks freed, to be recomputed later), which changes no output because sampling is seeded per
position. Waiting sequences are admitted first-come first-served while blocks and slots allow.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.block_manager import BlockManager
from services.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work. `num_new_tokens[i]` tokens of `seqs[i]` are fed, starting at its
    `num_computed_tokens`; `kv_imports` must be copied into their blocks before the forward."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    kv_imports: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def samples(self, i: int) -> bool:
        """Whether seqs[i] reaches its last token this step, so a token is sampled for it."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None = None  # chosen token and top alternatives, when asked


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: tuple[int, ...],
                 clock: Callable[[], float] = time.monotonic):
        """`clock` is the time base of `Sequence.arrival_time` (tests pass a fake one)."""
        assert config.max_num_batched_tokens >= config.max_num_seqs
        self.config = config
        self.clock = clock
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Seconds each prompt computed here waited before its first step, until the worker
        # reports them (`pdserve:request_queue_time_seconds`).
        self.queue_times: list[float] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Remove a request wherever it is and free its blocks; returns it, or None if unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, reason)
                    return seq
        return None

    # -- 1. schedule ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, seq.num_computed_tokens + num_new):
                continue  # seq itself was preempted; running[i] is now the next one (or none)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget, batch)
            if num_new is None:
                break  # first come, first served: do not let later requests overtake the head
            self.waiting.popleft()
            if seq.kv_payload is None and seq.num_preemptions == 0:  # its prompt starts here, now
                self.queue_times.append(self.clock() - seq.arrival_time)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make sure `seq` has blocks for `num_tokens`, preempting later sequences if needed."""
        while not self.block_manager.can_allocate(self.block_manager.blocks_needed(seq, num_tokens)):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int | None:
        """Claim blocks for a waiting sequence's first chunk; None if they are not free."""
        bm = self.block_manager
        if seq.kv_payload is not None:  # KV computed elsewhere: only the first output token is fed
            if not bm.can_allocate(bm.blocks_needed(seq, seq.num_tokens)):
                return None
            bm.allocate(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens - 1
            batch.kv_imports.append(seq)
            return 1
        # A prompt whose logprobs are wanted is computed in full: cached blocks have no logits.
        cached = [] if seq.wants_prompt_logprobs else bm.find_cached_prefix(seq.token_ids)
        num_cached_tokens = len(cached) * bm.block_size
        num_new = min(seq.num_tokens - num_cached_tokens, budget)
        fresh = -(-(num_cached_tokens + num_new) // bm.block_size) - len(cached)
        # Reviving cached blocks that sit in the free list also consumes free blocks.
        num_revived = sum(1 for b in cached if bm.blocks[b].ref_count == 0)
        if not bm.can_allocate(fresh + num_revived):
            return None
        bm.allocate_prefix(seq, cached)
        bm.allocate(seq, num_cached_tokens + num_new)
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached_tokens
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- 3. update ------------------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, sampled: list[SampledToken | None],
               prompt_logprobs: dict[int, list[dict[int, float]]] | None = None) -> list[Sequence]:
        """Advance every scheduled sequence; append sampled tokens (and the prompt logprobs computed
        this step, by batch index); finish and free what is done.

        Returns the sequences that received a token this step (finished ones included).
        """
        touched: list[Sequence] = []
        for i, entries in (prompt_logprobs or {}).items():
            batch.seqs[i].prompt_logprobs += entries
        for i, seq in enumerate(batch.seqs):
            seq.kv_payload = None
            seq.num_computed_tokens += batch.num_new_tokens[i]
            token = sampled[i]
            if token is not None:
                seq.token_ids.append(token.token_id)
                if token.logprobs is not None:
                    seq.output_logprobs.append(token.logprobs)
                touched.append(seq)
            self.block_manager.cache_full_blocks(seq)
            reason = self._finish_reason(seq) if token is not None else None
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
        return touched

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        # The sampler never picks EOS or a stop token id before `min_tokens`, so no check here.
        params, last = seq.params, seq.token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
