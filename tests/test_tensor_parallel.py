"""Tensor parallelism in the engine (CPU, gloo): a TP = 2 engine (this process is rank 0, the other
rank a spawned process) generates what a single engine does, and hands KV to engines of another size.

One group per process, so the TP engines here run one after another, each closed before the next.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services import Engine, SamplingParams
from services.model_config import ModelConfig
from services.scheduler import SampledToken
from services.tensor_parallel_shards import ShardLayout, check_tensor_parallel

PROMPTS = [[1, 5, 6, 7, 8], list(range(3, 3 + 37)), [1]]  # shorter than a block, several blocks, one token
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
OPTIONS = dict(dtype="float32", num_threads=1)  # one core per rank on a 2-core host


def generate(model, size: int, params: SamplingParams = GREEDY, prompts=PROMPTS):
    engine = Engine(model, tensor_parallel_size=size, **OPTIONS)
    try:
        return engine.generate(prompts, params)
    finally:
        engine.close()


def assert_same(single, parallel) -> None:
    """Identical greedy tokens; logprobs (log-softmax of the logits) within 1e-4."""
    for a, b in zip(single, parallel):
        assert b.token_ids == a.token_ids
        for rows_a, rows_b in ((a.logprobs, b.logprobs), (a.prompt_logprobs[1:], b.prompt_logprobs[1:])):
            for row_a, row_b in zip(rows_a, rows_b, strict=True):
                assert row_b.keys() == row_a.keys()
                np.testing.assert_allclose(list(row_b.values()), list(row_a.values()), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def one_kv_head(tiny_path, tmp_path_factory):
    """The tiny model with a single kv head (its first): two ranks must replicate it."""
    out = tmp_path_factory.mktemp("models") / "tiny-mqa"
    shutil.copytree(tiny_path, out)
    config = json.loads((out / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    config["num_key_value_heads"] = 1
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(out / "model.safetensors")
    for name in list(weights):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] = weights[name][:head_dim].clone()
    save_file(weights, out / "model.safetensors")
    return out


def test_tiny_tp2_equals_tp1_and_its_prefix_cache_serves_a_repeat(tiny_path):
    single = generate(tiny_path, 1)
    engine = Engine(tiny_path, tensor_parallel_size=2, **OPTIONS)
    try:
        assert_same(single, engine.generate(PROMPTS, GREEDY))
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        again = engine.generate(PROMPTS[1:2], params)[0]  # its two full blocks come from every rank's cache
    finally:
        engine.close()
    assert again.num_cached_tokens == 32 and again.token_ids == single[1].token_ids


def test_stories260k_tp2_equals_tp1(stories_path):
    assert_same(generate(stories_path, 1), generate(stories_path, 2))


def test_fewer_kv_heads_than_ranks_replicates_them(one_kv_head):
    layouts = [ShardLayout.of(ModelConfig.from_folder(one_kv_head), r, 2) for r in range(2)]
    assert [(la.kv_head_start, la.num_kv_heads, la.kv_owner, la.head_start, la.num_heads) for la in layouts] == [
        (0, 1, True, 0, 2), (0, 1, False, 2, 2)]
    assert_same(generate(one_kv_head, 1), generate(one_kv_head, 2))


def test_sizes_that_do_not_divide_the_model_are_refused_by_number(tiny_path):
    config = ModelConfig.from_folder(tiny_path)
    with pytest.raises(ValueError) as error:
        check_tensor_parallel(config, 3)
    assert str(error.value) == (
        "tensor_parallel_size 3 does not divide this model: 4 attention heads, 2 kv heads (needs a multiple "
        "of 3, or a divisor of it to replicate), intermediate size 256, vocab size 512")
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide this model: 4 attention heads"):
        Engine(tiny_path, tensor_parallel_size=3, **OPTIONS)
    layouts = [ShardLayout.of(config, r, 4) for r in range(4)]  # 2 kv heads over 4 ranks: two replicas each
    assert [(la.kv_head_start, la.kv_owner, la.vocab_start, la.intermediate_size) for la in layouts] == [
        (0, True, 0, 64), (0, False, 128, 64), (1, True, 256, 64), (1, False, 384, 64)]


def prefill(engine: Engine, prompt: list[int], params: SamplingParams):
    engine.add_request("r", prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), export_kv=True)
    (out,) = engine.step()
    return out


def decode(engine: Engine, prompt: list[int], params: SamplingParams, out) -> list[int]:
    engine.add_prefilled("r", prompt, SampledToken(out.new_token_ids[0], out.new_logprobs[0]), params, out.kv)
    tokens = list(out.new_token_ids)
    while engine.has_unfinished_requests:
        for step in engine.step():
            tokens += step.new_token_ids
    return tokens


def test_kv_hands_off_between_tp_sizes(tiny_path):
    """TP = 2 prefill -> TP = 1 decode and TP = 1 prefill -> TP = 2 decode continue exactly as one
    engine would; the TP = 2 payload is two checksummed slices of one kv head each."""
    prompt, options = PROMPTS[1], OPTIONS
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, logprobs=1)
    single = Engine(tiny_path, **options)
    whole = single.generate([prompt], params)[0].token_ids

    wide = Engine(tiny_path, tensor_parallel_size=2, **options)
    try:
        sliced = prefill(wide, prompt, params)
    finally:
        wide.close()
    assert [(s.head_start, s.data.shape) for s in sliced.kv.slices] == [(0, (4, 2, 37, 1, 16)), (1, (4, 2, 37, 1, 16))]
    sliced.kv.verify(4, 2, 16, "float32")  # each slice's checksum, made on its own rank's side of the gather
    one = prefill(single, prompt, params)
    np.testing.assert_allclose(sliced.kv.data, one.kv.data, atol=1e-5, rtol=0)
    assert decode(Engine(tiny_path, **options), prompt, params, sliced) == whole

    wide = Engine(tiny_path, tensor_parallel_size=2, **options)
    try:
        # The group's work per step (its efficiency gauges' numerator) is the whole model's.
        for field in ("layer_matmul_params", "lm_head_params", "kv_bytes_per_token", "attention_flops_per_pair"):
            assert getattr(wide.runner.cost, field) == getattr(single.runner.cost, field)
        assert decode(wide, prompt, params, one) == whole
        assert wide.block_manager.num_free_blocks == wide.block_manager.num_blocks
    finally:
        wide.close()


def test_a_corrupt_slice_is_named(tiny_path):
    from services.errors import KVTransferError
    from services.kv_payload import KVPayload, KVSlice

    kv = KVPayload.from_slices([(0, np.zeros((4, 2, 3, 1, 16), np.float32)),
                                (1, np.ones((4, 2, 3, 1, 16), np.float32))], "float32")
    kv.verify(4, 2, 16, "float32")
    bad = KVPayload((kv.slices[0], KVSlice(np.zeros((4, 2, 3, 1, 16), np.float32), kv.slices[1].checksum, 1)), "float32")
    with pytest.raises(KVTransferError, match="checksum mismatch in heads from 1"):
        bad.verify(4, 2, 16, "float32")
    with pytest.raises(KVTransferError, match="covers 1 kv heads, expected 2"):
        KVPayload(kv.slices[:1], "float32").verify(4, 2, 16, "float32")
    assert [offset for offset, _ in kv.heads(0, 2)] == [0, 1]
    assert torch.equal(torch.from_numpy(kv.heads(1, 1)[0][1]), torch.ones(4, 2, 3, 1, 16))


def test_cores_split_between_workers_by_ranks_then_between_ranks(monkeypatch):
    from router import rank_placement
    from services.tensor_parallel_group import split_cpus

    monkeypatch.setattr(rank_placement.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert rank_placement.cpu_groups([1, 2]) == [(0, 1), (2, 3, 4, 5)]  # 8 cores // 3 ranks = 2 per rank
    assert rank_placement.cpu_groups([4, 4, 2]) == [None, None, None]  # fewer cores than ranks: unpinned
    assert split_cpus((2, 3, 4, 5), 2) == [(2, 3), (4, 5)]
    assert split_cpus((2,), 2) == [None, None]
    assert rank_placement.rank_options(0.0) == {"num_cpus": 1}
    assert rank_placement.rank_options(1.0) == {"num_gpus": 1, "num_cpus": 0}
