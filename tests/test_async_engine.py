"""AsyncEngine: the step loop in a thread, one asyncio stream per request, aborts and bad input."""

from __future__ import annotations

import asyncio
import time

import pytest

from services import Engine, SamplingParams
from services.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine(tiny_path):
    async_engine = AsyncEngine(Engine(model=tiny_path))
    yield async_engine
    async_engine.shutdown()


async def collect(stream) -> list[int]:
    tokens = []
    while True:
        outs = await stream.next_batch()
        tokens += [t for o in outs for t in o.new_token_ids]
        if outs[-1].finish_reason is not None:
            return tokens


def test_concurrent_requests_equal_offline_generate(engine, tiny_path):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    prompts = [[1, 5, 6], [1, 7, 8, 9, 10], [1, 2]]
    expected = [o.token_ids for o in Engine(model=tiny_path).generate(prompts, params)]

    async def run():
        streams = [engine.submit(f"c{i}", lambda e, i=i, p=p: e.add_request(f"c{i}", p, params))
                   for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect(s) for s in streams))

    assert asyncio.run(run()) == expected


def test_bad_request_fails_alone_and_abort_frees_blocks(engine):
    processed = engine.engine.num_tokens_processed

    async def run():
        bad = engine.submit("bad", lambda e: e.add_request("bad", [], SamplingParams()))
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await bad.next_batch()
        long = engine.submit("long", lambda e: e.add_request("long", [1, 2, 3], SamplingParams(
            max_tokens=1500, ignore_eos=True)))
        await long.next_batch()
        engine.abort("long")
        with pytest.raises(ValueError, match="already running"):
            engine.submit("dup", lambda e: None)
            engine.submit("dup", lambda e: None)

    engine.engine.step_delay_s = 0.01  # test-only pacing: 1,500 tokens take 15 s, so the abort finds it running
    try:
        asyncio.run(run())
        deadline = time.monotonic() + 30
        while engine.engine.has_unfinished_requests:  # the abort is applied by the engine thread
            assert time.monotonic() < deadline, "the aborted request still runs"
            time.sleep(0.05)
    finally:
        engine.engine.step_delay_s = 0.0
    assert engine.engine.num_tokens_processed - processed < 1500  # aborted, not run to its end
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
