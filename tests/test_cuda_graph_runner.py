"""Decode graphs: buckets, padding, persistent buffers and capture once per bucket.

On CPU the graph's forward runs eagerly from the same padded buffers a CUDA graph would read (the
capture function is the seam), so padding and buffer filling are tested here; the CUDA capture
itself is tested in the last test, which needs a GPU (benchmarks/gpu_check.sh runs it).
"""

from __future__ import annotations

import pytest
import torch

from services.batch_buckets import bucket_for, capture_sizes, is_decode_only, pad_decode_plan
from services.engine import Engine
from services.engine_config import EngineConfig
from services.sampling_params import SamplingParams
from services.step_plan import StepPlan

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# Ending one after another, so the decode batch shrinks 4, 3, 2, 1: buckets 4, 4 (one padding row), 2, 1.
STAGGERED = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 5, 4, 3)]
PROMPTS = [[5, 9, 3], [7, 7, 7, 7, 1], [2], [11, 4, 8, 15, 16, 23, 42, 8, 1, 3, 5, 6, 7, 8, 9, 10, 11, 12]]


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
    """Stands in for CUDA graph capture: counts the captures and 'replays' the forward eagerly."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays = 0

    def __call__(self, forward, pool):
        self.captured.append(len(self.captured))

        def replay():
            self.replays += 1
            return forward()
        return replay


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
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and len(capture.captured) == 4  # all at start
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (benchmarks/gpu_check.sh)")
def test_cuda_graphs_give_the_eager_tokens_on_the_gpu(tiny_path):
    eager = Engine(model=tiny_path, device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=8)
    graphed = Engine(model=tiny_path, device="cuda", dtype="float32", max_num_seqs=8)
    assert graphed.runner.decode_graphs is not None and sorted(graphed.runner.decode_graphs.graphs) == [1, 2, 4, 8]
    assert eager.runner.decode_graphs is None
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in graphed.generate(PROMPTS, GREEDY)] == expected
