"""Which attention kernels run on this host, for decode steps and for prefills: torch's SDPA paths or
the native kernels that read the paged pool in place, chosen by measurement like the linear kernels
(kernel_plan.py), one entry per attention shape and dtype in the plan's choice cache.

Legend: H query heads, K kv heads, Dh head dim, S pool slots, T a prompt's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F

from services.attention import AttentionMetadata, DecodeKernel, PrefillKernel, torch_decode_attention

# (candidates {name: zero-argument call}, device, rows) -> the fastest name: the plan's timer
Timer = Callable[[dict[str, Callable[[], object]], torch.device, int], str]
PREFILL_PROBE_TOKENS = 256  # one prompt of this many tokens is timed (no cached prefix)


def native_decode(module: ModuleType) -> DecodeKernel:
    def kernel(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return module.paged_decode_attention(q, kv_cache, meta.block_tables, meta.context_lens_tensor,
                                             meta.block_size, scale)
    return kernel


def native_prefill(module: ModuleType) -> PrefillKernel:
    return module.prefill_attention


def choose(native: ModuleType, cache, shape: tuple[int, int, int], dtype: torch.dtype, mode: str, timer: Timer
           ) -> tuple[str, str, int]:
    """("torch" | "native" for decode, the same for prefill, how many were measured now) for attention
    of `shape` (query heads, kv heads, head dim) in `dtype`; cache: the plan's ChoiceCache (choice_cache.py)."""
    if mode == "native":  # fixed: engines compared token by token compute alike
        return "native", "native", 0
    shape_name = "H{} K{} Dh{} {}".format(*shape, dtype)
    picks, measured = [], 0
    for entry, probe in ((f"decode attention {shape_name}", _decode_probe),
                         (f"prefill attention {shape_name}", _prefill_probe)):
        name = cache.get(entry, ("torch", "native"))
        if name is None:
            calls, rows = probe(native, shape, dtype)
            name = timer(calls, torch.device("cpu"), rows)
            measured += cache.put(entry, name)
        picks.append(name)
    return picks[0], picks[1], measured


def _decode_probe(native: ModuleType, shape: tuple[int, int, int], dtype: torch.dtype):
    heads, kv_heads, head_dim = shape
    num_seqs, context, block_size = 4, 256, 16
    pool = torch.randn(2, num_seqs * context, kv_heads, head_dim).to(dtype)  # [2, S, K, Dh]
    q = torch.randn(num_seqs, heads, head_dim).to(dtype)
    tables = torch.randperm(num_seqs * context // block_size).view(num_seqs, -1)
    meta = AttentionMetadata.for_decode([context] * num_seqs, tables, block_size)
    fns = {"torch": torch_decode_attention, "native": native_decode(native)}
    return {n: partial(f, q, pool, meta, head_dim**-0.5) for n, f in fns.items()}, num_seqs


def _prefill_probe(native: ModuleType, shape: tuple[int, int, int], dtype: torch.dtype):
    """A fresh prompt, timed as paged_attention runs it: SDPA on its own k/v, or the kernel on the pool."""
    heads, kv_heads, head_dim = shape
    tokens, block_size, scale = PREFILL_PROBE_TOKENS, 16, head_dim**-0.5
    q = torch.randn(tokens, heads, head_dim).to(dtype)  # [T, H, Dh]
    pool = torch.randn(2, tokens, kv_heads, head_dim).to(dtype)  # [2, S, K, Dh]: the prompt's k/v, block by block
    table = torch.randperm(tokens // block_size)
    slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    k, v = pool[0, slots], pool[1, slots]  # [T, K, Dh] in prompt order
    return {"torch": partial(_sdpa_fresh, q, k, v, scale),
            "native": partial(native.prefill_attention, q, pool, table, tokens, block_size, scale)}, tokens


def _sdpa_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention's torch path for a prompt without a cached prefix. q: [T, H, Dh]; k, v: [T, K, Dh]."""
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          is_causal=True, scale=scale, enable_gqa=True)
