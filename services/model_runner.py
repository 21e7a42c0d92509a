"""Turns a scheduled batch into tensors, runs the model over the paged KV pool, and samples.

Also the KV hand-off: export a sequence's KV as one contiguous array, import one into free blocks.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch

from services import gpu_decode_attention
from services.attention import AttentionMetadata, torch_decode_attention
from services.batch_buckets import capture_widths
from services.cuda_graph_runner import Capture, DecodeGraphs, capture_cuda_graph
from services.device_kv import DeviceKV
from services.heap_policy import keep_freed_memory
from services.kv_payload import KVPayload
from services.model import LlamaModel
from services.model_config import ModelConfig
from services.roofline import ModelCost, PhaseTotals
from services.sampler import logprob_entry, sample
from services.scheduler import SampledToken, ScheduledBatch
from services.sequence import Sequence
from services.step_plan import KVExport, KVImport, StepPlan
from services.weight_arena import HugePageArena

if TYPE_CHECKING:
    from services.tensor_parallel_runner import TensorParallel

log = logging.getLogger(__name__)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, block_size: int, num_blocks: int, max_model_len: int,
                 quantization: str | None = None, kernels: str = "auto",
                 parallel: TensorParallel | None = None) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.parallel = parallel  # None: a single engine; else this rank's shard and its group
        shard, group = (parallel.layout, parallel.group) if parallel else (None, None)
        self.model = LlamaModel(config, weights, max_model_len, device, quantization, kernels, shard, group)
        self.gpu_decode_attention = None  # on CUDA: the in-place paged decode kernel measured fastest here
        if device.type == "cuda" and kernels != "torch":
            shape = (self.model.num_heads, self.model.num_kv_heads, config.head_dim)
            self.gpu_decode_attention, self.model.decode_kernel = gpu_decode_attention.choose(
                shape, dtype, device, block_size, mode=kernels)
        # The pool: [L, 2, num_blocks + 1, block_size, K, Dh] (K: this rank's kv heads); kernels address
        # it by flat slot. The extra last block belongs to no sequence: a padded decode graph's dummy
        # rows write their KV there (services/cuda_graph_runner.py).
        num_kv_heads = self.model.num_kv_heads
        self.scratch_block = num_blocks
        shape = (config.num_layers, 2, num_blocks + 1, block_size, num_kv_heads, config.head_dim)
        # On a CPU in 2 MB pages: decode attention streams every context from it, and with 4 KB pages a 32 x 1,024
        # bf16 layer took 3.1-3.9 ms against 2.5-3.0 (AMD EPYC Zen 4, 2 threads; services/weight_arena.py)
        in_huge_pages = HugePageArena.zeros(shape, dtype) if device.type == "cpu" else None
        self.kv_cache = in_huge_pages if in_huge_pages is not None else torch.zeros(shape, dtype=dtype, device=device)
        self.kv_slots = self.kv_cache.view(config.num_layers, 2, (num_blocks + 1) * block_size,
                                           num_kv_heads, config.head_dim)  # [L, 2, S, K, Dh]
        if device.type == "cpu":  # after the weights and the pool: only the steps' blocks are kept for reuse
            keep_freed_memory()
        self.max_model_len = max_model_len
        self.decode_graphs: DecodeGraphs | None = None  # enable_decode_graphs: decode steps from CUDA graphs
        # Exported KV stays on this device as a DeviceKV (for Ray Direct Transport), not a host KVPayload
        self.export_on_device = False
        self.cost = ModelCost.of(self.model, self.kv_bytes_per_token)
        if parallel is not None:  # this rank's share of the work, times the ranks: the group's
            self.cost = parallel.group_cost(self.cost)
        self.phase_totals = PhaseTotals()  # work and busy time per phase, for the efficiency gauges

    def enable_decode_graphs(self, max_batch_size: int, max_seq_len: int, capture: Capture | None = None) -> bool:
        """Run decode steps of up to `max_batch_size` sequences, each of at most `max_seq_len` tokens,
        from graphs, all captured now (per batch size, and per width where the decode kernel gathers);
        False (and every step eager, with a warning) if a capture fails. `capture` defaults to CUDA
        graphs; tests pass one that runs the padded forward eagerly."""
        if self.parallel is not None:
            raise ValueError("decode graphs are not supported in a tensor-parallel group (its collectives run eagerly)")
        self.decode_graphs = None  # until every bucket is captured: a failed capture leaves every step eager
        widths = capture_widths(min(self.max_model_len, max_seq_len), self.block_size)
        # The torch reference gathers a graph's whole width, so it gets a graph per width; a kernel that
        # reads the pool in place reads only each context's blocks whatever the width: the full one serves
        gathers = (self.model.decode_kernel or torch_decode_attention) is torch_decode_attention
        graphs = DecodeGraphs(self.model, self.kv_slots, self.block_size, widths if gathers else widths[-1:],
                              self.scratch_block, max_batch_size, capture or capture_cuda_graph)
        try:
            graphs.capture_all()
        except Exception as error:  # e.g. a kernel that cannot be captured: serve eagerly rather than not at all
            log.warning("decode graph capture failed, decode steps run eagerly: %s: %s", type(error).__name__, error)
            return False
        self.decode_graphs = graphs
        return True

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_slots[:, :, 0].numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[SampledToken | None], dict[str, KVPayload],
                                                  dict[int, list[dict[int, float]]]]:
        """Forward one step. Returns a token per sequence that reached its last token (else None),
        the exported KV of every `export_kv` sequence whose prompt completed this step, and the
        prompt logprobs computed this step by batch index (sequences that asked for them).
        In a tensor-parallel group this runs on rank 0, which sends the plan to the other ranks."""
        start_time = time.perf_counter()
        plan = StepPlan([], [], [], [s.block_table for s in batch.seqs], list(batch.num_new_tokens),
                        [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)], [],
                        [KVImport(s.block_table, s.kv_payload.num_tokens, s.kv_payload) for s in batch.kv_imports])
        sampling_seqs = []
        prompt_rows: list[tuple[int, int, int]] = []  # (flat row, batch index, the prompt token it predicts)
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            if seq.wants_prompt_logprobs:  # the row at position j predicts prompt token j + 1
                for j in range(max(start, len(seq.prompt_logprobs)), min(start + num_new, seq.num_prompt_tokens - 1)):
                    prompt_rows.append((len(plan.input_ids) + j - start, i, seq.token_ids[j + 1]))
            plan.input_ids += seq.token_ids[start : start + num_new]
            plan.positions += range(start, start + num_new)
            plan.seq_index += [i] * num_new
            if batch.samples(i):
                plan.logit_indices.append(len(plan.input_ids) - 1)
                sampling_seqs.append(seq)
                if seq.export_kv:
                    plan.kv_exports.append(KVExport(seq.request_id, seq.block_table, seq.num_tokens))
        num_sampled = len(plan.logit_indices)
        plan.logit_indices += [row for row, _, _ in prompt_rows]
        if self.parallel is not None:
            self.parallel.group.broadcast(plan.for_followers())
        logits, exported = self.execute(plan)
        prompt_logprobs = self._prompt_logprobs(logits[num_sampled:], prompt_rows, batch)
        logits = logits[:num_sampled]
        tokens = iter(sample(logits, sampling_seqs, self.config.eos_token_ids, self.model.plan.native)
                      if sampling_seqs else [])
        sampled = [next(tokens) if batch.samples(i) else None for i in range(len(batch.seqs))]
        if self.device.type == "cuda" and not sampling_seqs:  # nothing sampled waited for the kernels
            torch.cuda.synchronize(self.device)  # (a middle prefill chunk): its busy time must include them
        self.phase_totals.record(self.cost, batch.num_new_tokens, plan.context_lens,
                                 len(sampling_seqs) + len(prompt_rows), time.perf_counter() - start_time)
        return sampled, exported, prompt_logprobs

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[torch.Tensor | None, dict[str, KVPayload]]:
        """Import KV, run the forward, export KV: the part every rank runs. Returns the logits
        [M, V] and the exported KV by request id (on a rank other than 0: None and {})."""
        for kv_import in plan.kv_imports:
            self._import(kv_import)
        if self.decode_graphs is not None and self.decode_graphs.can_run(plan):
            logits = self.decode_graphs.run(plan)
        else:  # prefill, mixed, or more sequences than the largest graph: eager
            meta = self.attention_metadata(plan)
            logits = self.model.forward(self._tensor(plan.input_ids), self._tensor(plan.positions), meta,
                                        self.kv_slots, self._tensor(plan.logit_indices))
        exported = {e.request_id: self._export(e) for e in plan.kv_exports}
        return logits, {rid: kv for rid, kv in exported.items() if kv is not None}

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: list[tuple[int, int, int]], batch: ScheduledBatch
                         ) -> dict[int, list[dict[int, float]]]:
        out: dict[int, list[dict[int, float]]] = {}
        if rows:  # [rows, V] can be large (up to the step's token budget): normalise in place
            logprobs = logits.sub_(logits.logsumexp(dim=-1, keepdim=True))
            for r, (_, i, target) in enumerate(rows):
                out.setdefault(i, []).append(logprob_entry(logprobs[r], target, batch.seqs[i].params.prompt_logprobs))
        return out

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _attention_metadata(self, batch: ScheduledBatch, positions: list[int], seq_index: list[int]
                            ) -> AttentionMetadata:
        """The metadata of a batch whose flat tokens sit at `positions` (for tests and step_profile)."""
        return self.attention_metadata(StepPlan(
            [], positions, seq_index, [s.block_table for s in batch.seqs], list(batch.num_new_tokens),
            [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)], []))

    def attention_metadata(self, plan: StepPlan) -> AttentionMetadata:
        bs = self.block_size
        max_blocks = max(len(t) for t in plan.block_tables)
        block_tables = self._tensor([t + [0] * (max_blocks - len(t)) for t in plan.block_tables])
        pos = self._tensor(plan.positions)
        slot_mapping = block_tables[self._tensor(plan.seq_index), pos // bs] * bs + pos % bs  # [N]
        if all(n == 1 for n in plan.num_new_tokens):
            return AttentionMetadata.for_decode(plan.context_lens, block_tables, bs, slot_mapping)
        return AttentionMetadata(slot_mapping, list(plan.num_new_tokens), plan.context_lens, block_tables, bs, None)

    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        pos = torch.arange(num_tokens, device=self.device)
        table = self._tensor(block_table)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def export_kv(self, seq: Sequence, num_tokens: int) -> KVPayload:
        """The first `num_tokens` tokens' KV of `seq` as [L, 2, T, K, Dh], contiguous, on the host."""
        return self._export(KVExport(seq.request_id, seq.block_table, num_tokens))

    def import_kv(self, seq: Sequence) -> None:
        """Copy `seq.kv_payload` (verified by `Engine.add_prefilled`) into the sequence's blocks."""
        self._import(KVImport(seq.block_table, seq.kv_payload.num_tokens, seq.kv_payload))

    def _export(self, export: KVExport) -> KVPayload | DeviceKV | None:
        kv = self.kv_slots.index_select(2, self._slots(export.block_table, export.num_tokens))  # [L, 2, T, K, Dh]
        if self.parallel is not None:  # rank 0 collects the other ranks' heads; they return None
            return self.parallel.export_kv(kv, self.dtype)
        if self.export_on_device:
            return DeviceKV.of(kv)
        return KVPayload.from_array(to_wire(kv.cpu(), self.dtype), DTYPE_NAMES[self.dtype])

    def _import(self, kv_import: KVImport) -> None:
        slots = self._slots(kv_import.block_table, kv_import.num_tokens)
        if isinstance(kv_import.payload, DeviceKV):  # one copy, device to device
            if self.parallel is not None:
                raise ValueError("KV on a device (Ray Direct Transport) cannot be imported by a tensor-parallel group")
            kv_import.payload.copy_into(self.kv_slots, slots)
            return
        if self.parallel is not None:  # rank 0 sends each rank its heads, re-sliced from the payload
            self.parallel.import_kv(kv_import.payload, kv_import.num_tokens, slots, self.kv_slots)
            return
        copy_heads(self.kv_slots, slots, kv_import.payload.heads(0, self.config.num_kv_heads), self.dtype)


def copy_heads(kv_slots: torch.Tensor, slots: torch.Tensor, pieces: list[tuple[int, np.ndarray]],
               dtype: torch.dtype) -> None:
    """Write hand-off pieces (offset among the pool's heads, [L, 2, T, n, Dh]) into the pool [L, 2, S, K, Dh]."""
    for offset, piece in pieces:
        heads = kv_slots[:, :, :, offset : offset + piece.shape[3]]
        heads.index_copy_(2, slots, from_wire(piece, dtype).to(kv_slots.device))


def to_wire(kv: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A host tensor as the hand-off's numpy array (bf16 as its int16 bit pattern)."""
    return kv.view(torch.int16).numpy() if dtype == torch.bfloat16 else kv.numpy()


def from_wire(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The hand-off's numpy array as a tensor, read in place."""
    with warnings.catch_warnings():  # object-store buffers are read-only; torch only reads this one
        warnings.simplefilter("ignore", UserWarning)
        kv = torch.from_numpy(array)  # zero-copy view
    return kv.view(torch.bfloat16) if dtype == torch.bfloat16 else kv
