"""Decode graphs: buckets and widths, padding, persistent buffers and capture once per bucket.

On CPU the graph's forward runs eagerly from the same padded buffers a CUDA graph would read (the
capture function is the seam), so padding and buffer filling are tested here; the CUDA capture
itself is tested in the last test, which needs a GPU (benchmarks/gpu_check.sh runs it).
"""

from __future__ import annotations

import pytest
import torch

from services.attention import torch_decode_attention
from services.batch_buckets import bucket_for, capture_sizes, capture_widths, is_decode_only, pad_decode_plan
from services.engine import Engine
from services.engine_config import EngineConfig
from services.sampling_params import SamplingParams
from services.step_plan import StepPlan

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# Ending one after another, so the decode batch shrinks 4, 3, 2, 1: buckets 4, 4 (one padding row), 2, 1.
STAGGERED = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 5, 4, 3)]
PROMPTS = [[5, 9, 3], [7, 7, 7, 7, 1], [2], [11, 4, 8, 15, 16, 23, 42, 8, 1, 3, 5, 6, 7, 8, 9, 10, 11, 12]]
# A 509-token prompt decodes at contexts 510, 511, 512 (32 blocks of 16), then 513, 514 (33 blocks)
ACROSS_A_WIDTH = [[(7 * i + 3) % 500 for i in range(509)], [5, 9, 3]]


def test_capture_sizes_are_vllms_buckets():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 4)
    assert capture_sizes(5) == (1, 2, 4, 8)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 63, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 64, None]
    with pytest.raises(ValueError, match="max_batch_size must be at least 1, got 0"):
        capture_sizes(0)


def test_capture_widths_are_4x_rungs_up_to_the_full_width():
    assert capture_widths(8192, 16) == (32, 128, 512)  # 512, 2,048, 8,192 tokens
    assert capture_widths(16384, 16) == (32, 128, 512, 1024)
    assert capture_widths(1024, 16) == (32, 64)
    assert capture_widths(10000, 16) == (32, 128, 625)  # 8,192 would not halve 10,000: no rung for it
    assert capture_widths(8200, 16) == (32, 128, 513)  # the full width not a multiple of the block size
    assert capture_widths(8192, 24) == (22, 86, 342)  # nor the rungs: 528, 2,064, 8,208 tokens
    assert capture_widths(600, 16) == (38,)  # a 512 rung would gather nearly the full 608
    assert capture_widths(20, 4) == (5,)  # the full width below the first rung
    assert capture_widths(1, 16) == (1,)
    assert capture_widths(8192, 1024) == (1, 2, 8)
    assert capture_widths(8192, 4096) == (1, 2)  # 512 and 2,048 tokens are both one block
    blocks = (1, 32, 33, 128, 129, 512, 513)
    assert [bucket_for(n, (32, 128, 512)) for n in blocks] == [32, 32, 128, 128, 512, 512, None]
    with pytest.raises(ValueError, match="max_seq_len and block_size must be at least 1, got 0 and 16"):
        capture_widths(0, 16)


def test_padding_rows_live_in_the_scratch_block():
    plan = StepPlan([3, 4, 5], [7, 20, 0], [0, 1, 2], [[2], [5, 6], [9]], [1, 1, 1], [8, 21, 1], [0, 1, 2])
    padded = pad_decode_plan(plan, 8, scratch_block=99)
    assert padded.input_ids == [3, 4, 5, 0, 0, 0, 0, 0]
    assert padded.positions == [7, 20, 0, 0, 0, 0, 0, 0]
    assert padded.seq_index == list(range(8))
    assert padded.block_tables == [[2], [5, 6], [9]] + [[99]] * 5
    assert padded.context_lens == [8, 21, 1, 1, 1, 1, 1, 1]
    assert padded.logit_indices == list(range(8))
    assert plan.input_ids == [3, 4, 5]  # the step's own plan is untouched
    prefill = StepPlan([3, 4], [0, 1], [0, 0], [[2]], [2], [2], [1])
    middle_chunk = StepPlan([3], [4], [0], [[2]], [1], [5], [])  # one prompt token that samples nothing
    assert not is_decode_only(prefill) and not is_decode_only(middle_chunk) and is_decode_only(plan)
    with pytest.raises(ValueError, match="only a decode-only step"):
        pad_decode_plan(prefill, 4, 99)
    with pytest.raises(ValueError, match="cannot pad 3 sequences down to 2"):
        pad_decode_plan(plan, 2, 99)


def test_config_validates_the_graph_fields():
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be at least 1, got 0"):
        EngineConfig(model="m", max_cudagraph_capture_size=0)
    with pytest.raises(ValueError, match="max_seq_len_to_capture must be at least 1, got 0"):
        EngineConfig(model="m", max_seq_len_to_capture=0)
    with pytest.raises(ValueError, match="enforce_eager must be true or false, got 'yes'"):
        EngineConfig(model="m", enforce_eager="yes")
    assert EngineConfig(model="m").uses_cuda_graphs("cuda")
    assert not EngineConfig(model="m", enforce_eager=True).uses_cuda_graphs("cuda")
    assert not EngineConfig(model="m").uses_cuda_graphs("cpu")
    assert not EngineConfig(model="m", tensor_parallel_size=2).uses_cuda_graphs("cuda")


class EagerCapture:
    """Stands in for CUDA graph capture: counts the captures and 'replays' the forward eagerly,
    noting which capture (by its index: `DecodeGraphs.graphs` keeps capture order) each replay was."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replayed: list[int] = []

    def __call__(self, forward, pool):
        index = len(self.captured)
        self.captured.append(index)

        def replay():
            self.replayed.append(index)
            return forward()
        return replay

    @property
    def replays(self) -> int:
        return len(self.replayed)


@pytest.fixture(scope="module")
def eager_reference(tiny_path):
    return [o.token_ids for o in Engine(model=tiny_path).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def staggered_reference(tiny_path):
    return [o.token_ids for o in Engine(model=tiny_path).generate(PROMPTS, STAGGERED)]


def test_padded_graph_forward_gives_the_eager_tokens(tiny_path, staggered_reference):
    engine = Engine(model=tiny_path, max_num_seqs=8)
    capture = EagerCapture()
    engine.runner.enable_decode_graphs(8, 64, capture)
    graphs = engine.runner.decode_graphs
    # 64 tokens are 4 blocks of 16, too few for a narrower width: one width, whatever the kernel
    assert sorted(graphs.graphs) == [(1, 4), (2, 4), (4, 4), (8, 4)]
    assert len(capture.captured) == 4  # all at start
    buffers = [b.data_ptr() for b in (graphs.input_ids, graphs.positions, graphs.slot_mapping,
                                      graphs.context_lens, graphs.block_tables)]
    outputs = [o.token_ids for o in engine.generate(PROMPTS, STAGGERED)]
    assert outputs == staggered_reference
    assert capture.replays == 5 and len(capture.captured) == 4  # five decode steps; no capture in them
    assert [b.data_ptr() for b in (graphs.input_ids, graphs.positions, graphs.slot_mapping,
                                   graphs.context_lens, graphs.block_tables)] == buffers
    # The scratch block is outside the block manager's range, so no sequence ever owns it.
    assert graphs.scratch_block == engine.block_manager.num_blocks


def test_three_sequences_pad_to_four_and_match(tiny_path, eager_reference):
    engine = Engine(model=tiny_path, max_num_seqs=4)
    engine.runner.enable_decode_graphs(4, 64, EagerCapture())
    outputs = [o.token_ids for o in engine.generate(PROMPTS[:3], GREEDY)]
    assert outputs == eager_reference[:3]


def test_batches_above_the_largest_graph_run_eagerly(tiny_path, eager_reference):
    engine = Engine(model=tiny_path, max_num_seqs=4)
    capture = EagerCapture()
    engine.runner.enable_decode_graphs(2, 64, capture)  # graphs for 1 and 2 sequences only
    outputs = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert outputs == eager_reference
    assert len(capture.captured) == 2


def test_contexts_longer_than_the_graphs_run_eagerly(tiny_path, eager_reference):
    engine = Engine(model=tiny_path, max_num_seqs=4, block_size=4)
    capture = EagerCapture()
    engine.runner.enable_decode_graphs(4, 20, capture)  # 5 blocks of 4: contexts up to 20 tokens
    outputs = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert outputs == eager_reference
    # All four prefill in one step, then decode together five times; the 18-token prompt's contexts
    # are 19, 20, 21, 22, 23: the first two steps replay graphs, the last three (past 20) run eagerly.
    assert capture.replays == 2


def test_a_failed_capture_leaves_every_step_eager(tiny_path, eager_reference, caplog):
    def refuse(forward, pool):
        raise RuntimeError("operation not permitted when stream is capturing")
    engine = Engine(model=tiny_path, max_num_seqs=4)
    assert engine.runner.enable_decode_graphs(4, 64, refuse) is False
    assert engine.runner.decode_graphs is None
    assert "decode graph capture failed, decode steps run eagerly: RuntimeError" in caplog.text
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == eager_reference


@pytest.fixture(scope="module")
def across_a_width_reference(tiny_path):
    engine = Engine(model=tiny_path, max_num_seqs=4, kernels="torch")
    return [o.token_ids for o in engine.generate(ACROSS_A_WIDTH, GREEDY)]


def test_a_gathering_kernel_runs_the_narrowest_width_that_holds_the_step(tiny_path, across_a_width_reference):
    engine = Engine(model=tiny_path, max_num_seqs=4, kernels="torch")  # no native decode chain either
    assert engine.runner.model.decode_kernel is torch_decode_attention
    capture = EagerCapture()
    assert engine.runner.enable_decode_graphs(4, 1024, capture)
    graphs = engine.runner.decode_graphs
    assert graphs.widths == (32, 64)  # 512 and 1,024 tokens in blocks of 16
    captured = list(graphs.graphs)  # every (size, width), widest first, each width's largest size first
    assert captured == [(4, 64), (2, 64), (1, 64), (4, 32), (2, 32), (1, 32)] and len(capture.captured) == 6
    outputs = [o.token_ids for o in engine.generate(ACROSS_A_WIDTH, GREEDY)]
    assert outputs == across_a_width_reference
    # One prefill step, then five decode steps of the two: the longest table has 32, 32, 32, 33, 33 blocks
    assert [captured[i] for i in capture.replayed] == [(2, 32)] * 3 + [(2, 64)] * 2
    assert len(capture.captured) == 6


def test_a_kernel_that_reads_in_place_keeps_one_full_width(tiny_path):
    engine = Engine(model=tiny_path, max_num_seqs=4, kernels="torch")

    def in_place(q, kv_cache, meta, scale):  # not the gathering reference itself: counted as in place
        return torch_decode_attention(q, kv_cache, meta, scale)
    engine.runner.model.decode_kernel = in_place
    capture = EagerCapture()
    assert engine.runner.enable_decode_graphs(4, 1024, capture)
    assert list(engine.runner.decode_graphs.graphs) == [(4, 64), (2, 64), (1, 64)]
    assert len(capture.captured) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (benchmarks/gpu_check.sh)")
def test_cuda_graphs_give_the_eager_tokens_on_the_gpu(tiny_path):
    eager = Engine(model=tiny_path, device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=8)
    graphed = Engine(model=tiny_path, device="cuda", dtype="float32", max_num_seqs=8)
    graphs = graphed.runner.decode_graphs
    widths = capture_widths(min(graphed.max_model_len, 8192), 16)
    gathers = graphed.runner.gpu_decode_attention == "torch"  # several widths only for the gathering kernel
    assert graphs is not None and graphs.widths == (widths if gathers else widths[-1:])
    assert list(graphs.graphs) == [(size, w) for w in reversed(graphs.widths) for size in (8, 4, 2, 1)]
    assert eager.runner.decode_graphs is None
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in graphed.generate(PROMPTS, GREEDY)] == expected
