"""`DecodeGraphs`: decode steps replayed from CUDA graphs, one graph per (batch size, width) bucket.

A decode step of the `1b` preset is ~675 small kernels; issued one by one from Python they take
longer than the GPU needs to run them. A graph issues them all at once. A graph replays fixed
addresses and shapes, so every input lives in a persistent buffer that each step fills in place,
the batch is padded up to its bucket (services/batch_buckets.py), and attention sees block tables
of a fixed width with its mask made inside the graph from the context lengths. Every graph is
captured once, at engine start (largest first, all sharing one memory pool, as vLLM does), never
in the steady state.

The width: a kernel that reads the pool in place (FlashAttention, FlexAttention, the native CPU
kernel) reads only each context's blocks, so one width serves, the full max_seq_len_to_capture /
block_size (longer contexts run eagerly). The torch reference gathers every position of the width:
at the full 8,192 tokens a batch of 32 contexts of ~128 stepped in 14.8 ms against 8.5 eagerly
(H100, 1b bf16, benchmarks/decode_graphs.py), so with it each batch size is captured at every width
of `capture_widths` and a step runs the narrowest that holds its longest block table.

Legend: G the bucket's batch size, W max blocks per sequence (the widest graph's), w a graph's
width in blocks (<= W), T = W * block_size, V vocab size.
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
    """The captured decode graphs of one engine, by (batch size, width in blocks), and the buffers
    they read. `widths`: ascending, the last the full width (one width for an in-place kernel).
    `capture` records a forward (CUDA: `capture_cuda_graph`; a test passes one that runs it eagerly)."""

    def __init__(self, model: LlamaModel, kv_slots: torch.Tensor, block_size: int, widths: tuple[int, ...],
                 scratch_block: int, max_batch_size: int, capture: Capture = capture_cuda_graph) -> None:
        self.model, self.kv_slots = model, kv_slots
        self.block_size, self.scratch_block = block_size, scratch_block
        self.sizes, self.widths = capture_sizes(max_batch_size), widths
        max_blocks_per_seq = widths[-1]
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture is capture_cuda_graph else None
        device, largest = kv_slots.device, self.sizes[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)
        # The persistent inputs: rows [0, G) (and columns [0, w)) of each are what the graph of (G, w) reads.
        self.input_ids, self.positions, self.slot_mapping = buffer(largest), buffer(largest), buffer(largest)
        self.context_lens = buffer(largest)  # [G]
        self.block_tables = buffer(largest, max_blocks_per_seq)  # [G, W]
        self.logit_indices = torch.arange(largest, device=device)
        self.context_range = torch.arange(max_blocks_per_seq * block_size, device=device)  # [T]
        # One upload per step, of its [G, 4 + w] rows: flat, so that each such view is contiguous (pinned)
        self._host = torch.zeros(largest * (4 + max_blocks_per_seq), dtype=torch.int64)
        if device.type == "cuda":
            self._host = self._host.pin_memory()
        self.graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}  # by (G, w), in capture order

    def can_run(self, plan: StepPlan) -> bool:
        return (is_decode_only(plan) and bucket_for(len(plan.num_new_tokens), self.sizes) is not None
                and bucket_for(max(map(len, plan.block_tables)), self.widths) is not None)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (size, width), largest first (smaller graphs then reuse the largest one's memory)."""
        for width in reversed(self.widths):
            for size in reversed(self.sizes):
                self._graph(size, width)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """The logits [B, V] of a decode step (`can_run(plan)`), from the graph of the smallest batch
        size >= B and the narrowest width that holds its longest block table."""
        num_seqs = len(plan.num_new_tokens)
        size = bucket_for(num_seqs, self.sizes)
        width = bucket_for(max(map(len, plan.block_tables)), self.widths)
        graph = self._graph(size, width)
        self._fill(pad_decode_plan(plan, size, self.scratch_block), width)
        return graph()[:num_seqs]

    def _graph(self, size: int, width: int) -> Callable[[], torch.Tensor]:
        graph = self.graphs.get((size, width))
        if graph is None:  # capture from dummy rows (all in the scratch block): it runs the forward
            self._fill(pad_decode_plan(StepPlan([], [], [], [], [], [], []), size, self.scratch_block), width)
            graph = self.graphs[size, width] = self.capture(lambda: self._forward(size, width), self.pool)
        return graph

    def _fill(self, plan: StepPlan, width: int) -> None:
        """Write the padded plan into rows [0, G), block-table columns [0, w), of the buffers, in place
        (one host-to-device copy). Columns past w keep an earlier step's blocks: a graph of width w
        never reads them."""
        size, bs = len(plan.num_new_tokens), self.block_size
        host = self._host[: size * (4 + width)].view(size, 4 + width)
        host.zero_()
        host[:, 0] = torch.tensor(plan.input_ids)
        host[:, 1] = torch.tensor(plan.positions)
        host[:, 2] = torch.tensor([table[p // bs] * bs + p % bs for table, p in zip(plan.block_tables, plan.positions)])
        host[:, 3] = torch.tensor(plan.context_lens)
        for row, table in enumerate(plan.block_tables):
            if len(table) > width:
                raise ValueError(f"a block table of {len(table)} blocks exceeds the graph's width of {width}")
            host[row, 4 : 4 + len(table)] = torch.tensor(table)
        device = self.input_ids.device
        rows = host.to(device, non_blocking=True)  # the pinned buffer is rewritten only after this step's replay
        for column, target in enumerate((self.input_ids, self.positions, self.slot_mapping, self.context_lens)):
            target[:size].copy_(rows[:, column])
        self.block_tables[:size, :width].copy_(rows[:, 4:])

    def _forward(self, size: int, width: int) -> torch.Tensor:
        """The decode forward of bucket (size, width) over the buffers: what a graph records. The mask
        is computed here, so each replay makes it from that step's context lengths; its last dimension
        is what the torch kernel gathers."""
        lens = self.context_lens[:size]
        positions = self.context_range[: width * self.block_size]  # [w * block_size]
        mask = (positions[None, :] < lens[:, None])[:, None, None, :]  # [G, 1, 1, w * block_size]
        meta = AttentionMetadata(self.slot_mapping[:size], [1] * size, [], self.block_tables[:size, :width],
                                 self.block_size, mask, lens)
        return self.model.forward(self.input_ids[:size], self.positions[:size], meta, self.kv_slots,
                                  self.logit_indices[:size])
