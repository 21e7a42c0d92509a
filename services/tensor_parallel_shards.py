"""Megatron-style sharding of a Llama-family checkpoint over the ranks of a tensor-parallel group.

Column-parallel (split by output rows): q/k/v by heads, gate/up by intermediate rows, lm_head and
the embedding by vocabulary rows. Row-parallel (split by input columns): o and down, whose partial
products the ranks sum with one all-reduce each. Norms are replicated. With fewer kv heads than
ranks, each kv head is replicated on size / K ranks (as vLLM does), and each rank keeps the query
heads that read it. Imports torch only to slice tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine_config import check_tensor_parallel
from services.model_config import ModelConfig

__all__ = ["ShardLayout", "check_tensor_parallel", "kv_head_range", "shard_weights"]


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds: its query heads, kv heads, intermediate rows and vocab rows."""

    rank: int
    size: int
    num_heads: int  # local query heads (H / size)
    head_start: int
    num_kv_heads: int  # local kv heads (K / size, or 1 when replicated)
    kv_head_start: int
    kv_owner: bool  # the first replica of its kv heads: the rank that exports them
    intermediate_size: int
    vocab_start: int
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> ShardLayout:
        check_tensor_parallel(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        kv_start, kv_count, replicas = kv_head_range(config.num_kv_heads, rank, size)
        heads, ffn, vocab = config.num_heads // size, config.intermediate_size // size, config.vocab_size // size
        return cls(rank, size, heads, rank * heads, kv_count, kv_start, rank % replicas == 0,
                   ffn, rank * vocab, vocab)


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int, int]:
    """(first kv head, kv heads, replicas of each) that rank `rank` of a group of `size` holds."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per, 1
    replicas = size // num_kv_heads
    return rank // replicas, 1, replicas


def shard_weights(weights: dict[str, torch.Tensor], config: ModelConfig, layout: ShardLayout) -> None:
    """Replace, in `weights` (Hugging Face names), every sharded tensor by this rank's part."""
    dh = config.head_dim

    def rows(name: str, start: int, count: int) -> None:
        if name in weights:  # a copy, so the whole tensor can be freed
            weights[name] = weights[name][start : start + count].clone()

    def columns(name: str, start: int, count: int) -> None:
        weights[name] = weights[name][:, start : start + count].contiguous()

    kv = (layout.kv_head_start * dh, layout.num_kv_heads * dh)
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in ("weight", "bias"):
            rows(attn + f"q_proj.{suffix}", layout.head_start * dh, layout.num_heads * dh)
            rows(attn + f"k_proj.{suffix}", *kv)
            rows(attn + f"v_proj.{suffix}", *kv)
        columns(attn + "o_proj.weight", layout.head_start * dh, layout.num_heads * dh)
        ffn = (layout.rank * layout.intermediate_size, layout.intermediate_size)
        rows(mlp + "gate_proj.weight", *ffn)
        rows(mlp + "up_proj.weight", *ffn)
        columns(mlp + "down_proj.weight", *ffn)
    rows("model.embed_tokens.weight", layout.vocab_start, layout.vocab_size)
    rows("lm_head.weight", layout.vocab_start, layout.vocab_size)
