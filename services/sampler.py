"""Turn logits into tokens: penalties, bias, filters, and seeded sampling that is a pure function of
(seed, position, logits), so a request resumed on another worker continues identically.

Legend: M rows to sample (one per sequence), V vocab size.
"""

from __future__ import annotations

from types import ModuleType

import torch

from services.scheduler import SampledToken
from services.sequence import Sequence

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def exponential_noise(seeds: list[int], positions: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """E[m, v] ~ Exp(1), a counter-based hash of (seeds[m], positions[m], v); [M, V] float64.

    argmax(p / E) samples from p (the exponential race), so the draw needs no generator state.
    """
    keys = [splitmix64(splitmix64(s) ^ p) & _MASK32 for s, p in zip(seeds, positions)]
    x = torch.tensor(keys, dtype=torch.int64, device=device)[:, None]
    x = x ^ ((torch.arange(vocab_size, dtype=torch.int64, device=device) * 0x9E3779B1) & _MASK32)
    for _ in range(2):  # the "hash32" integer finaliser; products stay below 2**63
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    return -torch.log((x.double() + 0.5) / 2**32)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...],
           native: ModuleType | None = None) -> list[SampledToken]:
    """logits: [M, V] float32, row m for seqs[m], whose next token sits at position seqs[m].num_tokens; native: the
    native kernels (services/kernels/native.py), where the step's kernel plan has them."""
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
    adjusted = [m for m, s in enumerate(seqs) if _needs_adjustment(s)]
    if adjusted:  # most steps have none: skip the copy of [M, V] logits
        logits = logits.clone()
        for m in adjusted:
            _apply_penalties_and_bias(logits[m], seqs[m], eos_token_ids)
    token_ids = greedy_tokens(logits, native)
    random_rows = [m for m, s in enumerate(seqs) if not s.params.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [seqs[m].params for m in random_rows])
        noise = exponential_noise([seqs[m].seed for m in random_rows], [seqs[m].num_tokens for m in random_rows],
                                  logits.shape[1], logits.device)
        token_ids[rows] = (probs.double() / noise).argmax(dim=-1)
    chosen = token_ids.tolist()
    out = []
    for m, seq in enumerate(seqs):
        lp = None if seq.params.logprobs is None else logprob_entry(raw_logprobs[m], chosen[m], seq.params.logprobs)
        out.append(SampledToken(chosen[m], lp))
    return out


def greedy_tokens(logits: torch.Tensor, native: ModuleType | None) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) [M] int64; on a CPU with the native build its one pass over the rows
    (kernels/argmax_rows.cpp: the same indices; [32, 32,000] 0.08 ms against torch's 1.2)."""
    if native is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1)


def logprob_entry(row: torch.Tensor, token_id: int, num_top: int) -> dict[int, float]:
    """`token_id`'s logprob and the `num_top` most likely alternatives', from a log-softmax row [V]."""
    entry = {token_id: row[token_id].item()}
    if num_top > 0:
        top = torch.topk(row, num_top)
        entry.update(zip(top.indices.tolist(), top.values.tolist()))
    return entry


def _needs_adjustment(seq: Sequence) -> bool:
    p = seq.params
    return bool(p.logit_bias or seq.num_output_tokens < p.min_tokens or p.repetition_penalty != 1.0
                or ((p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens))


def _apply_penalties_and_bias(row: torch.Tensor, seq: Sequence, eos_token_ids: tuple[int, ...]) -> None:
    # row: [V], modified in place
    p = seq.params
    for token_id, bias in p.logit_bias.items():
        if 0 <= token_id < row.shape[0]:
            row[token_id] += bias
    if seq.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        row[[t for t in banned if 0 <= t < row.shape[0]]] = float("-inf")
    if p.repetition_penalty != 1.0:  # over prompt and output, as in vLLM / HF
        seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:  # over output only (OpenAI)
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=row.device), minlength=row.shape[0])
        row -= p.frequency_penalty * counts[: row.shape[0]] + p.presence_penalty * (counts[: row.shape[0]] > 0)


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; returns probabilities [R, V] with filtered-out zeros."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temps[:, None]
    top_ks = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < logits.shape[1] for k in top_ks) or any(tp < 1.0 for tp in top_ps):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
        drop = ranks >= torch.tensor(top_ks, device=logits.device)[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= mass_before.new_tensor(top_ps)[:, None]
        logits = logits.scatter(1, sorted_idx, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
    if bool((min_ps > 0).any()):
        probs = probs.masked_fill(probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
