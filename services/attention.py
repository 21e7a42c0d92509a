"""Attention over the paged KV pool: the pure-torch reference path, for CPU and GPU alike.

Legend: N new tokens in the flat batch, B sequences, H query heads, K kv heads, Dh head dim,
S pool slots (num_blocks * block_size), T context length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where one step's tokens write their KV and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [N] int64: pool slot of each new token's k/v
    query_lens: list[int]  # [B] new tokens per sequence (contiguous in the flat batch)
    context_lens: list[int]  # [B] tokens visible after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64: each context's blocks, padded with block 0
    block_size: int
    decode_mask: torch.Tensor | None  # [B, 1, 1, T_max] bool when every query_len is 1, else None
    context_lens_tensor: torch.Tensor | None = None  # [B] int64, the same as context_lens (decode steps)
    # A mixed step's one-token rows as a decode batch of their own, made on the first layer's use
    _decode_part: tuple[torch.Tensor, AttentionMetadata] | None = field(default=None, repr=False)

    @staticmethod
    def for_decode(context_lens: list[int], block_tables: torch.Tensor, block_size: int,
                   slot_mapping: torch.Tensor | None = None) -> AttentionMetadata:
        """A decode batch's metadata: one query per sequence, written to `slot_mapping` (None: its
        k/v are in the pool already)."""
        lens = torch.tensor(context_lens, dtype=torch.int64, device=block_tables.device)
        ctx = torch.arange(max(context_lens), device=block_tables.device)
        mask = (ctx[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, T_max]
        if slot_mapping is None:
            slot_mapping = torch.empty(0, dtype=torch.int64, device=block_tables.device)
        return AttentionMetadata(slot_mapping, [1] * len(context_lens), list(context_lens), block_tables, block_size,
                                 mask, lens)

    def decode_part(self) -> tuple[torch.Tensor, AttentionMetadata] | None:
        """In a mixed step (some sequences prefill, some decode): the flat rows of the sequences
        with one new token [Bd], and their metadata as a decode batch; None when there are none."""
        if self._decode_part is None:
            starts, rows, seqs = 0, [], []
            for i, query_len in enumerate(self.query_lens):
                if query_len == 1:
                    rows.append(starts)
                    seqs.append(i)
                starts += query_len
            if not seqs:
                return None
            device = self.block_tables.device
            tables = self.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.int64, device=device))
            self._decode_part = (torch.tensor(rows, dtype=torch.int64, device=device),
                                 AttentionMetadata.for_decode([self.context_lens[i] for i in seqs], tables,
                                                              self.block_size))
        return self._decode_part


# (q [B, H, Dh], one layer's pool [2, S, K, Dh], meta, scale) -> [B, H, Dh]: one query per sequence
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, "AttentionMetadata", float], torch.Tensor]
# (q [T, H, Dh], one layer's pool [2, S, K, Dh], block_table [max_blocks], context_len, block_size, scale)
# -> [T, H, Dh]: one sequence's T new tokens, query j at position context_len - T + j, causally over its
# context read from the pool (the new k/v already in it)
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, float], torch.Tensor]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    decode_kernel: DecodeKernel | None = None, prefill_kernel: PrefillKernel | None = None,
) -> torch.Tensor:
    """Store the new k/v in the pool, then attend causally over each sequence's context; a decode
    step (one query per sequence) goes to `decode_kernel` (default: the torch reference below), each
    sequence with several new tokens to `prefill_kernel` (default: SDPA, on its fresh k/v or on its
    context gathered out of the pool).

    q: [N, H, Dh]; k, v: [N, K, Dh]; kv_cache: [2, S, K, Dh] (one layer). Returns [N, H, Dh].
    """
    kv_cache[0].index_copy_(0, meta.slot_mapping, k)
    kv_cache[1].index_copy_(0, meta.slot_mapping, v)
    kernel = decode_kernel or torch_decode_attention
    if meta.decode_mask is not None:
        return kernel(q, kv_cache, meta, scale)
    out = torch.empty_like(q)
    decoding = meta.decode_part()
    if decoding is not None:  # the decoding sequences as one batch, not one SDPA call each
        rows, decode_meta = decoding
        out[rows] = kernel(q[rows], kv_cache, decode_meta, scale)
    start = 0
    for i, (query_len, context_len) in enumerate(zip(meta.query_lens, meta.context_lens)):
        end = start + query_len
        if query_len == 1:  # done above
            start = end
            continue
        if prefill_kernel is not None:
            out[start:end] = prefill_kernel(q[start:end], kv_cache, meta.block_tables[i], context_len,
                                            meta.block_size, scale)
            start = end
            continue
        q_i = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, Dh]
        if context_len == query_len:  # no cached prefix: attend to the fresh k/v directly
            k_i, v_i = k[start:end].transpose(0, 1).unsqueeze(0), v[start:end].transpose(0, 1).unsqueeze(0)
            mask, causal = None, True
        else:  # [1, K, T, Dh] each
            k_i, v_i = _gather_context(kv_cache, meta.block_tables[i : i + 1], meta.block_size, context_len)
            causal = False
            # query j sits at position context_len - query_len + j and sees keys up to it
            query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=True)  # [1, H, q, Dh]
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


def torch_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
                           ) -> torch.Tensor:
    """The reference decode kernel: gather every context out of the pool at once, then one batched,
    masked SDPA. q: [B, H, Dh]; kv_cache: [2, S, K, Dh]. Returns [B, H, Dh]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    keys, values = _gather_context(kv_cache, meta.block_tables, meta.block_size, meta.decode_mask.shape[-1])
    # The H / K query heads that share a kv head attend as H / K query rows of that head, so the
    # keys and values are never expanded to H heads.
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)


def _gather_context(kv_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first `num_tokens` positions of each block table: [B, K, T, Dh] each.

    Whole blocks are copied with `index_select` (contiguous rows of block_size * K * Dh elements),
    which is several times faster on CPU than indexing slot by slot.
    """
    num_seqs, num_blocks = block_tables.shape
    _, _, num_kv_heads, head_dim = kv_cache.shape
    blocks = kv_cache.view(2, -1, block_size, num_kv_heads, head_dim)
    flat = block_tables.reshape(-1)
    shape = (num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    keys = blocks[0].index_select(0, flat).view(shape)[:, :num_tokens].transpose(1, 2)
    values = blocks[1].index_select(0, flat).view(shape)[:, :num_tokens].transpose(1, 2)
    return keys, values
