"""Turns a scheduled batch into tensors, runs the model over the paged KV pool, and samples.

Also the KV hand-off: export a sequence's KV as one contiguous array, import one into free blocks.
"""

from __future__ import annotations

import time
import warnings

import torch

from services.attention import AttentionMetadata
from services.kv_payload import KVPayload
from services.model import LlamaModel
from services.model_config import ModelConfig
from services.roofline import ModelCost, PhaseTotals
from services.sampler import logprob_entry, sample
from services.scheduler import SampledToken, ScheduledBatch
from services.sequence import Sequence

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, block_size: int, num_blocks: int, max_model_len: int,
                 quantization: str | None = None, kernels: str = "auto") -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.model = LlamaModel(config, weights, max_model_len, device, quantization, kernels)
        # The pool: [L, 2, num_blocks, block_size, K, Dh]; kernels address it by flat slot.
        self.kv_cache = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads,
                                    config.head_dim, dtype=dtype, device=device)
        self.kv_slots = self.kv_cache.view(config.num_layers, 2, num_blocks * block_size,
                                           config.num_kv_heads, config.head_dim)  # [L, 2, S, K, Dh]
        self.cost = ModelCost.of(self.model, self.kv_bytes_per_token)
        self.phase_totals = PhaseTotals()  # work and busy time per phase, for the efficiency gauges

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_slots[:, :, 0].numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[SampledToken | None], dict[str, KVPayload],
                                                  dict[int, list[dict[int, float]]]]:
        """Forward one step. Returns a token per sequence that reached its last token (else None),
        the exported KV of every `export_kv` sequence whose prompt completed this step, and the
        prompt logprobs computed this step by batch index (sequences that asked for them)."""
        start_time = time.perf_counter()
        for seq in batch.kv_imports:
            self.import_kv(seq)
        input_ids, positions, seq_index = [], [], []
        logit_indices, sampling_seqs = [], []
        prompt_rows: list[tuple[int, int, int]] = []  # (flat row, batch index, the prompt token it predicts)
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            if seq.wants_prompt_logprobs:  # the row at position j predicts prompt token j + 1
                for j in range(max(start, len(seq.prompt_logprobs)), min(start + num_new, seq.num_prompt_tokens - 1)):
                    prompt_rows.append((len(input_ids) + j - start, i, seq.token_ids[j + 1]))
            input_ids += seq.token_ids[start : start + num_new]
            positions += range(start, start + num_new)
            seq_index += [i] * num_new
            if batch.samples(i):
                logit_indices.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
        meta = self._attention_metadata(batch, positions, seq_index)
        logits = self.model.forward(self._tensor(input_ids), self._tensor(positions), meta, self.kv_slots,
                                    self._tensor(logit_indices + [row for row, _, _ in prompt_rows]))
        prompt_logprobs = self._prompt_logprobs(logits[len(logit_indices) :], prompt_rows, batch)
        logits = logits[: len(logit_indices)]
        exported = {s.request_id: self.export_kv(s, s.num_tokens) for s in sampling_seqs if s.export_kv}
        tokens = iter(sample(logits, sampling_seqs, self.config.eos_token_ids) if sampling_seqs else [])
        sampled = [next(tokens) if batch.samples(i) else None for i in range(len(batch.seqs))]
        if self.device.type == "cuda" and not sampling_seqs:  # nothing sampled waited for the kernels
            torch.cuda.synchronize(self.device)  # (a middle prefill chunk): its busy time must include them
        self.phase_totals.record(self.cost, batch.num_new_tokens, meta.context_lens,
                                 len(sampling_seqs) + len(prompt_rows), time.perf_counter() - start_time)
        return sampled, exported, prompt_logprobs

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

    def _attention_metadata(self, batch: ScheduledBatch, positions: list[int], seq_index: list[int]) -> AttentionMetadata:
        bs = self.block_size
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        block_tables = self._tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs])
        pos = self._tensor(positions)
        slot_mapping = block_tables[self._tensor(seq_index), pos // bs] * bs + pos % bs  # [N]
        context_lens = [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)]
        decode_mask = lens = None
        if all(n == 1 for n in batch.num_new_tokens):
            lens = self._tensor(context_lens)
            ctx = torch.arange(max(context_lens), device=self.device)
            decode_mask = (ctx[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, T_max]
        return AttentionMetadata(slot_mapping, list(batch.num_new_tokens), context_lens, block_tables, bs,
                                 decode_mask, lens)

    def _slots(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        pos = torch.arange(num_tokens, device=self.device)
        table = self._tensor(seq.block_table)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def export_kv(self, seq: Sequence, num_tokens: int) -> KVPayload:
        """The first `num_tokens` tokens' KV of `seq` as [L, 2, T, K, Dh], contiguous, on the host."""
        kv = self.kv_slots.index_select(2, self._slots(seq, num_tokens)).cpu()
        name = DTYPE_NAMES[self.dtype]
        array = kv.view(torch.int16).numpy() if self.dtype == torch.bfloat16 else kv.numpy()
        return KVPayload.from_array(array, name)

    def import_kv(self, seq: Sequence) -> None:
        """Copy `seq.kv_payload` (verified by `Engine.add_prefilled`) into the sequence's blocks."""
        payload: KVPayload = seq.kv_payload
        with warnings.catch_warnings():  # object-store buffers are read-only; torch only reads this one
            warnings.simplefilter("ignore", UserWarning)
            kv = torch.from_numpy(payload.data)  # zero-copy view
        if self.dtype == torch.bfloat16:
            kv = kv.view(torch.bfloat16)
        self.kv_slots.index_copy_(2, self._slots(seq, payload.num_tokens), kv.to(self.device))
