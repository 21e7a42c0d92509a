"""What each engine step must do, in the units of its hardware ceiling: FLOPs for a step that
prefills (compute-bound), bytes read for a pure decode step (memory-bound). The engine keeps running
totals per phase; workers report them, and the router turns them into utilization gauges, so a
deployment shows how close each phase runs to its own ceiling (see BENCHMARKING.md for the method
the benchmarks use with the same formulas).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from services.int4_weight import Int4Weight
from services.quantized_weight import Int8Weight


@dataclass(frozen=True)
class ModelCost:
    """The static part: parameters the forward multiplies by, and bytes it reads per step."""

    layer_matmul_params: int  # per token: every 2-D weight of every layer
    lm_head_params: int  # per sampled row
    weight_bytes: int  # everything a forward reads, each storage once
    attention_flops_per_pair: int  # per (query token, context token): QK^T and PV over all layers
    kv_bytes_per_token: int  # one token's keys and values, all layers

    @classmethod
    def of(cls, model, kv_bytes_per_token: int) -> ModelCost:
        seen: set[int] = set()
        counts = {"layer": 0, "head": 0, "bytes": 0}

        def add(tensor: torch.Tensor | Int8Weight | Int4Weight | None, key: str | None) -> None:
            params = None  # quantized: its parameters, and the bytes it really reads
            if isinstance(tensor, Int8Weight):
                add(tensor.scale, None)
                tensor = tensor.qweight
            elif isinstance(tensor, Int4Weight):  # two parameters a byte (plus padding to whole blocks)
                add(tensor.scale, None)
                add(tensor.low, None)
                params = tensor.shape.numel()
                tensor = tensor.packed
            # by address: a tied output projection is the embedding; a weight held only in its copies has no storage
            # (bf16_panels.ValuesDropped, address 0): by identity
            where = None if tensor is None else tensor.data_ptr() or id(tensor)
            if where is None or where in seen:
                return
            seen.add(where)
            if key is not None:
                counts[key] += tensor.numel() if params is None else params
            counts["bytes"] += tensor.numel() * tensor.element_size()

        add(model.lm_head, "head")
        add(model.final_norm, None)
        for layer in model.layers:
            for field in dataclasses.fields(layer):
                tensor = getattr(layer, field.name)
                add(tensor, "layer" if tensor is not None and len(tensor.shape) == 2 else None)
        c = model.config
        return cls(counts["layer"], counts["head"], counts["bytes"], 4 * c.num_layers * c.num_heads * c.head_dim,
                   kv_bytes_per_token)

    def prefill_flops(self, query_lens: list[int], context_lens: list[int], num_sampled: int) -> int:
        """FLOPs of a step feeding `query_lens[i]` tokens to sequence i, which then sees
        `context_lens[i]` tokens (causal: query j of n sees context - n + j + 1 of them)."""
        pairs = sum(q * (ctx - q) + q * (q + 1) // 2 for q, ctx in zip(query_lens, context_lens))
        return (2 * self.layer_matmul_params * sum(query_lens) + 2 * self.lm_head_params * num_sampled
                + self.attention_flops_per_pair * pairs)

    def decode_bytes(self, context_lens: list[int]) -> int:
        """Bytes a decode step reads: every weight once, and each sequence's whole KV."""
        return self.weight_bytes + self.kv_bytes_per_token * sum(context_lens)


@dataclass
class PhaseTotals:
    """Running totals of the work done and the busy seconds it took, per phase."""

    prefill_flops: int = 0
    prefill_seconds: float = 0.0
    decode_bytes: int = 0
    decode_seconds: float = 0.0

    def record(self, cost: ModelCost, query_lens: list[int], context_lens: list[int], num_sampled: int,
               seconds: float) -> None:
        if all(q == 1 for q in query_lens):
            self.decode_bytes += cost.decode_bytes(context_lens)
            self.decode_seconds += seconds
        else:  # a step with any prompt chunk is compute-bound: counted as prefill
            self.prefill_flops += cost.prefill_flops(query_lens, context_lens, num_sampled)
            self.prefill_seconds += seconds
