"""Decode attention on CUDA that reads the paged pool in place (no gather), chosen by measurement.

Candidates, each used only where it loads and matches the torch reference on a test batch:
- `flash`: FlashAttention's `flash_attn_with_kvcache` with a block table: FA3 (`flash_attn_interface`,
  `page_table=`) at any block size, or FA2 (`flash_attn`, `block_table=`), whose paged path needs
  a block size that is a multiple of 256;
- `flex`: PyTorch's FlexAttention over the whole pool, with a block mask made from the block tables
  (each sequence's blocks are its only kv tiles; the mask keeps its first context_len positions);
- `torch`: the reference (gather each context, one masked SDPA), always there: the fallback.
All three have static shapes for a given batch, so a decode CUDA graph can record any of them.

Legend: B sequences, H query heads, K kv heads, Dh head dim, S pool slots, NB pool blocks, W max blocks.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from functools import partial

import torch

from services.attention import AttentionMetadata, DecodeKernel, torch_decode_attention
from services.hardware_peaks import best_seconds

log = logging.getLogger(__name__)


def flash_kernel(block_size: int, import_module: Callable = importlib.import_module) -> DecodeKernel | None:
    """FlashAttention's paged decode, if a build that takes this block size is installed."""
    for module_name, table_arg, usable in (("flash_attn_interface", "page_table", True),
                                           ("flash_attn", "block_table", block_size % 256 == 0)):
        try:
            fn = import_module(module_name).flash_attn_with_kvcache
        except (ImportError, AttributeError):
            continue
        if usable:
            return partial(_flash_decode, fn, table_arg)
    return None


def _flash_decode(fn: Callable, table_arg: str, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
    """q [B, H, Dh]; kv_cache [2, S, K, Dh] (one layer), seen as [NB, block_size, K, Dh] pages."""
    _, slots, num_kv_heads, head_dim = kv_cache.shape
    pages = kv_cache.view(2, slots // meta.block_size, meta.block_size, num_kv_heads, head_dim)
    out = fn(q.unsqueeze(1), pages[0], pages[1], cache_seqlens=meta.context_lens_tensor.to(torch.int32),
             softmax_scale=scale, causal=True, **{table_arg: meta.block_tables.to(torch.int32)})
    return out.squeeze(1)  # [B, 1, H, Dh] -> [B, H, Dh]


@functools.cache  # one compiled kernel per process: every engine and graph bucket shares it
def flex_kernel(compile_: bool) -> DecodeKernel | None:
    """FlexAttention's paged decode (compiled on CUDA; eager on CPU, for tests)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None
    # dynamic: one compiled kernel for every batch size and pool (a graph bucket each would recompile)
    attend = torch.compile(flex_attention, dynamic=True) if compile_ else flex_attention
    return partial(_flex_decode, attend, BlockMask)


def _flex_decode(attend: Callable, block_mask_type: type, q: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, slots, num_kv_heads, _ = kv_cache.shape
    bs, tables, lens = meta.block_size, meta.block_tables, meta.context_lens_tensor
    width, num_blocks = tables.shape[1], slots // bs
    used = (lens + bs - 1) // bs  # [B] blocks each sequence fills
    valid = torch.arange(width, device=q.device)[None, :] < used[:, None]  # [B, W]
    # logical[b, p]: which of sequence b's blocks physical block p is (-1: not its); column NB takes the padding
    logical = torch.full((num_seqs, num_blocks + 1), -1, dtype=torch.int64, device=q.device)
    positions = torch.arange(width, device=q.device).expand(num_seqs, width)
    logical.scatter_(1, torch.where(valid, tables, num_blocks), positions)

    def mask_mod(b, h, q_idx, kv_idx):  # kv_idx: a pool slot
        block = logical[b, kv_idx // bs]
        return (block >= 0) & (block * bs + kv_idx % bs < lens[b])

    block_mask = block_mask_type.from_kv_blocks(
        used.to(torch.int32).view(num_seqs, 1, 1), tables.to(torch.int32).view(num_seqs, 1, 1, width),
        BLOCK_SIZE=(128, bs), mask_mod=mask_mod, seq_lengths=(1, slots), compute_q_blocks=False)  # forward only
    keys = kv_cache[0].permute(1, 0, 2).unsqueeze(0).expand(num_seqs, num_kv_heads, slots, head_dim)  # no copy
    values = kv_cache[1].permute(1, 0, 2).unsqueeze(0).expand(num_seqs, num_kv_heads, slots, head_dim)
    out = attend(q.unsqueeze(2), keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)  # [B, H, 1, Dh]
    return out.squeeze(2)


def candidates(block_size: int, device: torch.device, import_module: Callable = importlib.import_module,
               mode: str = "auto") -> dict[str, DecodeKernel]:
    """Every decode kernel that loads here, the torch reference last. Mode "native" (the tests'
    fixed choice, nothing compiled or timed): FlashAttention where installed, else torch."""
    found: dict[str, DecodeKernel] = {}
    flash = flash_kernel(block_size, import_module) if device.type == "cuda" else None
    if flash is not None:
        found["flash"] = flash
    flex = flex_kernel(compile_=device.type == "cuda") if mode == "auto" else None
    if flex is not None:
        found["flex"] = flex
    found["torch"] = torch_decode_attention
    return dict(list(found.items())[:1]) if mode == "native" else found


def choose(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, block_size: int,
           found: dict[str, DecodeKernel] | None = None, mode: str = "auto") -> tuple[str, DecodeKernel]:
    """The fastest candidate that computes what the reference does on a scattered test batch
    (shape: query heads, kv heads, head dim); the torch reference when no other one qualifies."""
    found = candidates(block_size, device, mode=mode) if found is None else found
    heads, kv_heads, head_dim = shape
    num_seqs, context = 8, 40 * block_size - 3  # a partial last block
    num_blocks = num_seqs * (context // block_size + 1) + 4
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(device, dtype)
    width = context // block_size + 1
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * width].view(num_seqs, width).to(device)
    meta = AttentionMetadata.for_decode([context - 7 * i for i in range(num_seqs)], tables, block_size)
    scale = head_dim**-0.5
    expected = torch_decode_attention(q, kv, meta, scale).float()
    timings = {}
    for name, kernel in found.items():
        try:
            got = kernel(q, kv, meta, scale).float()
        except Exception as error:  # a build that does not run here (arch, head dim, block size)
            log.info("decode attention %s unusable: %s: %s", name, type(error).__name__, error)
            continue
        if not torch.allclose(got, expected, atol=2e-2, rtol=2e-2):
            log.warning("decode attention %s differs from the reference by %.3g: not used", name,
                        float((got - expected).abs().max()))
            continue
        timings[name] = best_seconds(partial(kernel, q, kv, meta, scale), device, repeats=5)
    name = min(timings, key=timings.get) if timings else "torch"
    return name, found.get(name, torch_decode_attention)
