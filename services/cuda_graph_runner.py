"""`DecodeGraphs`: decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of the `1b` preset is ~675 small kernels; issued one by one from Python they take
longer than the GPU needs to run them. A graph issues them all at once. A graph replays fixed
addresses and shapes, so every input lives in a persistent buffer that each step fills in place,
the batch is padded up to its bucket (services/batch_buckets.py), and attention sees block tables
of a fixed width (max_seq_len_to_capture / block_size; longer contexts run eagerly) with its mask
made inside the graph from the context lengths. Every bucket is captured once, at engine start (largest first, all sharing one memory
pool, as vLLM does), never in the steady state.

Legend: G the bucket's batch size, W max blocks per sequence, T = W * block_size, V vocab size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.attention import AttentionMetadata
from services.batch_buckets import bucket_for, capture_sizes, is_decode_only, pad_decode_plan
from services.model import LlamaModel
from services.step_plan import StepPlan

# (the forward to record, the memory pool) -> a callable that replays it and returns its output
Capture = Callable[[Callable[[], torch.Tensor], object], Callable[[], torch.Tensor]]


def capture_cuda_graph(forward: Callable[[], torch.Tensor], pool: object) -> Callable[[], torch.Tensor]:
    """Record `forward` as a CUDA graph in `pool`; the replay returns the graph's own output tensor.

    Two warm-up runs on a side stream first (torch's rule: lazy initialisation, cuBLAS workspaces and
    autotuning must not happen during capture). "thread_local": a Ray worker's other threads (the
    object store, the checksum thread) may allocate while this one captures.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return output
    return replay


class DecodeGraphs:
    """The captured decode graphs of one engine and the buffers they read. `capture` records a
    forward (CUDA: `capture_cuda_graph`; a test passes one that counts calls and runs it eagerly)."""

    def __init__(self, model: LlamaModel, kv_slots: torch.Tensor, block_size: int, max_blocks_per_seq: int,
                 scratch_block: int, max_batch_size: int, capture: Capture = capture_cuda_graph) -> None:
        self.model, self.kv_slots = model, kv_slots
        self.block_size, self.scratch_block = block_size, scratch_block
        self.sizes = capture_sizes(max_batch_size)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture is capture_cuda_graph else None
        device, largest = kv_slots.device, self.sizes[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)
        # The persistent inputs: rows [0, G) of each are what the graph of bucket G reads.
        self.input_ids, self.positions, self.slot_mapping = buffer(largest), buffer(largest), buffer(largest)
        self.context_lens = buffer(largest)  # [G]
        self.block_tables = buffer(largest, max_blocks_per_seq)  # [G, W]
        self.logit_indices = torch.arange(largest, device=device)
        self.context_range = torch.arange(max_blocks_per_seq * block_size, device=device)  # [T]
        self._host = torch.zeros(largest, 4 + max_blocks_per_seq, dtype=torch.int64)  # one upload per step
        if device.type == "cuda":
            self._host = self._host.pin_memory()
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def can_run(self, plan: StepPlan) -> bool:
        return (is_decode_only(plan) and bucket_for(len(plan.num_new_tokens), self.sizes) is not None
                and max(plan.context_lens) <= self.context_range.numel())

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first (smaller graphs then reuse the largest one's memory)."""
        for size in reversed(self.sizes):
            self._graph(size)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """The logits [B, V] of a decode step (`can_run(plan)`), from its bucket's graph."""
        num_seqs = len(plan.num_new_tokens)
        size = bucket_for(num_seqs, self.sizes)
        graph = self._graph(size)
        self._fill(pad_decode_plan(plan, size, self.scratch_block))
        return graph()[:num_seqs]

    def _graph(self, size: int) -> Callable[[], torch.Tensor]:
        graph = self.graphs.get(size)
        if graph is None:  # capture from dummy rows (all in the scratch block): it runs the forward
            self._fill(pad_decode_plan(StepPlan([], [], [], [], [], [], []), size, self.scratch_block))
            graph = self.graphs[size] = self.capture(lambda: self._forward(size), self.pool)
        return graph

    def _fill(self, plan: StepPlan) -> None:
        """Write the padded plan into rows [0, G) of the buffers, in place (one host-to-device copy)."""
        size, width, bs = len(plan.num_new_tokens), self.block_tables.shape[1], self.block_size
        host = self._host[:size]
        host.zero_()
        host[:, 0] = torch.tensor(plan.input_ids)
        host[:, 1] = torch.tensor(plan.positions)
        host[:, 2] = torch.tensor([table[p // bs] * bs + p % bs for table, p in zip(plan.block_tables, plan.positions)])
        host[:, 3] = torch.tensor(plan.context_lens)
        for row, table in enumerate(plan.block_tables):
            if len(table) > width:
                raise ValueError(f"a block table of {len(table)} blocks exceeds the graphs' {width}")
            host[row, 4 : 4 + len(table)] = torch.tensor(table)
        device = self.input_ids.device
        rows = host.to(device, non_blocking=True)  # the pinned buffer is rewritten only after this step's replay
        for column, target in enumerate((self.input_ids, self.positions, self.slot_mapping, self.context_lens)):
            target[:size].copy_(rows[:, column])
        self.block_tables[:size].copy_(rows[:, 4:])

    def _forward(self, size: int) -> torch.Tensor:
        """The decode forward of bucket `size` over the buffers: what a graph records. The mask is
        computed here, so each replay makes it from that step's context lengths."""
        lens = self.context_lens[:size]
        mask = (self.context_range[None, :] < lens[:, None])[:, None, None, :]  # [G, 1, 1, T]
        meta = AttentionMetadata(self.slot_mapping[:size], [1] * size, [], self.block_tables[:size],
                                 self.block_size, mask, lens)
        return self.model.forward(self.input_ids[:size], self.positions[:size], meta, self.kv_slots,
                                  self.logit_indices[:size])
