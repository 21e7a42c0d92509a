"""KV export -> import into a second engine -> continued decode equals an uninterrupted run."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from services import Engine, SamplingParams
from services.errors import KVTransferError
from services.kv_payload import KVPayload, KVSlice
from services.scheduler import SampledToken
from services.sequence import Sequence

PROMPT = list(range(5, 5 + 37))  # two full blocks and a partial one


def prefill(engine: Engine, params: SamplingParams):
    engine.add_request("r", PROMPT, SamplingParams(**{**params.__dict__, "max_tokens": 1}), export_kv=True)
    (out,) = engine.step()
    assert out.kv is not None and out.finish_reason == "length"
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_handoff_continues_exactly(tiny_path, dtype, temperature):
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=11, ignore_eos=True, logprobs=1)
    whole = Engine(model=tiny_path, dtype=dtype).generate([PROMPT], params)[0]

    prefill_engine = Engine(model=tiny_path, dtype=dtype)
    out = prefill(prefill_engine, params)
    assert out.kv.data.shape == (4, 2, len(PROMPT), 2, 16) and out.kv.dtype == dtype
    assert prefill_engine.block_manager.num_free_blocks == prefill_engine.block_manager.num_blocks
    decode_engine = Engine(model=tiny_path, dtype=dtype)
    first = SampledToken(out.new_token_ids[0], out.new_logprobs[0])
    decode_engine.add_prefilled("r", PROMPT, first, params, out.kv)
    tokens = list(out.new_token_ids)
    while decode_engine.has_unfinished_requests:
        for step in decode_engine.step():
            tokens += step.new_token_ids
    assert tokens == whole.token_ids
    assert decode_engine.block_manager.num_free_blocks == decode_engine.block_manager.num_blocks


def test_export_import_round_trip_is_bit_exact(tiny_path):
    engine = Engine(model=tiny_path, dtype="bfloat16")
    out = prefill(engine, SamplingParams(temperature=0))
    other = Engine(model=tiny_path, dtype="bfloat16")
    seq = Sequence("x", PROMPT + [out.new_token_ids[0]], len(PROMPT), SamplingParams(), 0, 0)
    other.block_manager.allocate(seq, seq.num_tokens)
    seq.kv_payload = out.kv
    other.runner.import_kv(seq)
    again = other.runner.export_kv(seq, len(PROMPT))
    assert again.checksum == out.kv.checksum
    assert np.array_equal(again.data, out.kv.data)


def test_corrupt_or_mismatched_kv_is_refused(tiny_path):
    engine = Engine(model=tiny_path)
    kv = prefill(engine, SamplingParams(temperature=0)).kv
    flipped = kv.data.copy()
    flipped.reshape(-1).view(np.uint8)[1234] ^= 1  # one bit
    with pytest.raises(KVTransferError, match="checksum mismatch"):
        KVPayload((KVSlice(flipped, kv.checksum),), kv.dtype).verify(4, 2, 16, "float32")
    with pytest.raises(KVTransferError, match="dtype"):
        kv.verify(4, 2, 16, "bfloat16")
    with pytest.raises(KVTransferError, match="shape"):
        kv.verify(5, 2, 16, "float32")
    with pytest.raises(ValueError, match="KV covers 37 tokens"):
        engine.add_prefilled("y", PROMPT[:-1], SampledToken(5), SamplingParams(), kv)


def test_a_check_running_beside_the_copy_gates_the_request(tiny_path):
    """With `kv_check` (a verification already running on another thread) the KV is copied while
    it runs: a passing check continues exactly; a failing one ends only its own request, with the
    check's error and no token, and frees its blocks."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    whole = Engine(model=tiny_path).generate([PROMPT], params)[0]
    out = prefill(Engine(model=tiny_path), params)
    engine = Engine(model=tiny_path)
    first = SampledToken(out.new_token_ids[0])
    good, bad = Future(), Future()
    engine.add_prefilled("good", PROMPT, first, params, out.kv, kv_check=good)
    engine.add_prefilled("bad", PROMPT, first, params, out.kv, kv_check=bad)
    with ThreadPoolExecutor(1) as pool:  # the engine step waits for both results
        pool.submit(lambda: (time.sleep(0.2), good.set_result(None), bad.set_exception(KVTransferError("mismatch"))))
        outputs = {o.request_id: o for o in engine.step()}
    assert outputs["bad"].new_token_ids == [] and outputs["bad"].finish_reason == "abort"
    assert isinstance(outputs["bad"].error, KVTransferError) and outputs["good"].error is None
    tokens = list(out.new_token_ids) + outputs["good"].new_token_ids
    while engine.has_unfinished_requests:
        for step in engine.step():
            assert step.request_id == "good"
            tokens += step.new_token_ids
    assert tokens == whole.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
