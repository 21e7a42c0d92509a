"""The multiplexed token stream, piece by piece: delta merging, the worker's OutputChannel and the
router's per-request RequestDeltas (unit tests; the real Ray path is in test_e2e_disaggregated)."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.output_channel import OutputChannel
from router.decode_channel import RequestDeltas, WorkerFailed
from services.protocol import TokenDelta
from services.request_output import StepOutput


def test_merge_concatenates_tokens_and_keeps_the_last_finish_reason():
    a = TokenDelta([1], [{1: -0.5}], None, 3)
    b = TokenDelta([2, 3], [{2: -0.25}, {3: -1.0}], "length", 3)
    assert TokenDelta.merge([a]) is a
    assert TokenDelta.merge([a, b]) == TokenDelta([1, 2, 3], [{1: -0.5}, {2: -0.25}, {3: -1.0}], "length", 3)
    assert TokenDelta.merge([TokenDelta([4], None, None), TokenDelta([], None, None, error="boom")]) == \
        TokenDelta([4], None, None, 0, "boom")
    lost = TokenDelta([], None, None, error="KVTransferError: checksum mismatch", kv_lost=True)
    assert TokenDelta.merge([TokenDelta([4], None, None), lost]) == \
        TokenDelta([4], None, None, 0, "KVTransferError: checksum mismatch", kv_lost=True)


def _out(rid: str, tokens: list[int], finish: str | None = None) -> StepOutput:
    return StepOutput(rid, tokens, None, finish, num_prompt_tokens=4, num_cached_tokens=0)


def test_output_channel_sends_one_entry_per_request_that_advanced():
    async def run():
        channel = OutputChannel(asyncio.get_running_loop())
        for rid in ("a", "b", "c"):
            channel.add(rid)
        channel.deliver(_out("a", [1]))
        channel.deliver(_out("b", [7]))
        channel.deliver(_out("a", [2]))  # a second step before the reader came: merged
        assert await channel.next_item() == [("a", TokenDelta([1, 2], None, None)), ("b", TokenDelta([7], None, None))]
        channel.deliver(_out("b", [8], "stop"))
        channel.fail("c", ValueError("bad KV"))  # from another thread in real life
        await asyncio.sleep(0)
        assert await channel.next_item() == [("b", TokenDelta([8], None, "stop")),
                                             ("c", TokenDelta([], None, None, 0, "ValueError: bad KV"))]
        assert channel.request_ids == {"a"}  # finished and failed requests are no longer live
        waiter = asyncio.create_task(channel.next_item())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # nothing new: the stream waits instead of sending empty items
        channel.deliver(_out("a", [3]))
        assert await waiter == [("a", TokenDelta([3], None, None))]

    asyncio.run(run())


def test_request_deltas_merge_what_piled_up_then_raise_the_failure():
    async def run():
        deltas = RequestDeltas()
        deltas.push(TokenDelta([1], None, None))
        deltas.push(TokenDelta([2], None, None))
        assert await deltas.get() == TokenDelta([1, 2], None, None)
        deltas.push(TokenDelta([3], None, None))
        deltas.fail(WorkerFailed("decode-0: the token stream ended"))
        assert await deltas.get() == TokenDelta([3], None, None)  # tokens before the failure still count
        with pytest.raises(WorkerFailed, match="stream ended"):
            await deltas.get()

    asyncio.run(run())
