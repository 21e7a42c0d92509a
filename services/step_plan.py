"""`StepPlan`: everything one forward needs, as plain lists (no torch, no sequences).

Rank 0 of a tensor-parallel group builds it from the scheduled batch and broadcasts it; every rank
runs the same forward from it. A single engine builds and runs it the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.kv_payload import KVPayload


@dataclass(slots=True)
class KVImport:
    """A prefilled sequence's KV to copy into its blocks before the forward."""

    block_table: list[int]
    num_tokens: int
    payload: KVPayload | None  # on rank 0 only: it sends each other rank that rank's heads


@dataclass(slots=True)
class KVExport:
    """A sequence whose prompt completes this step, and whose KV leaves with its first token."""

    request_id: str
    block_table: list[int]
    num_tokens: int


@dataclass(slots=True)
class StepPlan:
    input_ids: list[int]  # [N] the flat batch
    positions: list[int]  # [N]
    seq_index: list[int]  # [N] which sequence each token belongs to
    block_tables: list[list[int]]  # [B] each sequence's blocks
    num_new_tokens: list[int]  # [B]
    context_lens: list[int]  # [B] cached + new
    logit_indices: list[int]  # [M] rows to project: the sampled ones, then the prompt-logprob ones
    kv_imports: list[KVImport] = field(default_factory=list)
    kv_exports: list[KVExport] = field(default_factory=list)

    def for_followers(self) -> StepPlan:
        """This plan without the KV payloads (rank 0 sends each rank its heads point to point)."""
        if not self.kv_imports:
            return self
        imports = [KVImport(i.block_table, i.num_tokens, None) for i in self.kv_imports]
        return dataclasses.replace(self, kv_imports=imports)
