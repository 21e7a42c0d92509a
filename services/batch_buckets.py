"""The batch sizes and block-table widths decode steps are captured at, and a decode step's plan
padded up to a batch size (no torch).

vLLM's sizes: 1, 2, 4, then every multiple of 8 up to a cap. A decode step of n sequences runs the
graph of the smallest size >= n; the n..size-1 padding rows are dummy sequences whose one token
writes its KV into a scratch block no sequence owns and attends only to itself, and whose logits
are dropped. Steps with more sequences than the cap, prefill and mixed steps run eagerly.

Widths matter only to a decode kernel that gathers each context out of the pool (the torch
reference): a graph gathers its full width whatever the contexts, so a step runs the graph of the
narrowest width that holds its longest block table.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from services.step_plan import StepPlan

# The width ladder, in tokens: 512, 2,048, 8,192, ... A rung 4x the last keeps the captures few (each
# rung is one more graph per batch size) while a step past the first rung gathers under 4x its longest
# context (under 8x where capture_widths drops a rung for being too near the full width).
FIRST_WIDTH_TOKENS = 512
WIDTH_GROWTH = 4


def capture_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes to capture for batches of up to `max_batch_size` sequences: 1, 2, 4, then
    multiples of 8, the last one the first size >= max_batch_size (so every batch up to it has one)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    sizes = []
    for size in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        sizes.append(size)
        if size >= max_batch_size:
            return tuple(sizes)
    raise AssertionError("unreachable: the sizes grow without bound")


def capture_widths(max_seq_len: int, block_size: int) -> tuple[int, ...]:
    """The block-table widths, in blocks, to capture for contexts of up to `max_seq_len` tokens:
    512, 2,048, 8,192 ... tokens rounded up to whole blocks, then the full width (`max_seq_len` in
    blocks, rounded up). A rung is kept only if it at most halves the full width: a graph set that
    gathers nearly as much as the full one costs its captures and saves little."""
    if max_seq_len < 1 or block_size < 1:
        raise ValueError(f"max_seq_len and block_size must be at least 1, got {max_seq_len} and {block_size}")
    full = -(-max_seq_len // block_size)
    widths: list[int] = []
    tokens = FIRST_WIDTH_TOKENS
    while (width := -(-tokens // block_size)) * 2 <= full:
        if not widths or width > widths[-1]:  # blocks larger than a rung's tokens round two rungs alike
            widths.append(width)
        tokens *= WIDTH_GROWTH
    return (*widths, full)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest captured bucket (batch size, or width in blocks) that holds `n` (sequences, or
    blocks); None above the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def is_decode_only(plan: StepPlan) -> bool:
    """A step a decode graph can run: one new token per sequence, each one's logits sampled (no
    prompt-logprob rows, no middle-of-prompt chunk that samples nothing), in batch order."""
    num_seqs = len(plan.num_new_tokens)
    return (num_seqs > 0 and all(n == 1 for n in plan.num_new_tokens)
            and plan.logit_indices == list(range(num_seqs)))


def pad_decode_plan(plan: StepPlan, size: int, scratch_block: int) -> StepPlan:
    """`plan` (decode only) with `size - B` padding sequences appended: token 0 at position 0, block
    table [scratch_block], context of one token. The imports and exports stay with the real rows."""
    num_seqs = len(plan.num_new_tokens)
    if num_seqs and not is_decode_only(plan):  # (an empty plan pads to all dummy rows: graph capture)
        raise ValueError("only a decode-only step (one token per sequence, each sampled) can be padded")
    if size < num_seqs:
        raise ValueError(f"cannot pad {num_seqs} sequences down to {size}")
    pad = size - num_seqs
    return dataclasses.replace(
        plan, input_ids=plan.input_ids + [0] * pad, positions=plan.positions + [0] * pad,
        seq_index=plan.seq_index + list(range(num_seqs, size)),
        block_tables=plan.block_tables + [[scratch_block]] * pad, num_new_tokens=plan.num_new_tokens + [1] * pad,
        context_lens=plan.context_lens + [1] * pad, logit_indices=list(range(size)))
