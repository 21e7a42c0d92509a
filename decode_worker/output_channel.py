"""OutputChannel: the new tokens of all of one router's requests on this worker, as one stream.

Every item of a Ray streaming generator costs a few hundred microseconds of CPU on each side (a
report RPC, an object, a wake-up). With one stream per request that cost is paid per token per
request; the router topped out near 1,800 tokens/s, with the decode worker spending four times its
engine's CPU on the streams. A channel per (router, decode worker) pays it once per engine step:
each item carries, for every request of that router that advanced, the tokens since the last item
(several steps' worth when the router lags).
"""

from __future__ import annotations

import asyncio
import time

from services.errors import KVTransferError
from services.protocol import TokenDelta
from services.request_output import StepOutput


def _as_delta(out: StepOutput) -> TokenDelta:
    return TokenDelta(out.new_token_ids, out.new_logprobs, out.finish_reason, out.num_cached_tokens,
                      prompt_logprobs=out.prompt_logprobs)


class OutputChannel:
    """An `OutputSink` for many requests; `next_item` is what the channel's Ray stream yields."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.request_ids: set[str] = set()  # live requests whose outputs come here
        self.attached = False  # a router is reading the stream
        self.renewed = time.monotonic()  # when the router last said it is alive
        self.closed = False
        self._pending: dict[str, list[TokenDelta]] = {}
        self._ready = asyncio.Event()

    def close(self) -> None:
        """End the stream: `next_item` returns None from now on."""
        self.closed = True
        self._ready.set()

    def add(self, request_id: str) -> None:
        self.request_ids.add(request_id)

    def deliver(self, out: StepOutput) -> None:
        self._push(out.request_id, _as_delta(out))

    def fail(self, request_id: str, error: BaseException) -> None:
        """From any thread: end the request with an error the router will raise."""
        self.loop.call_soon_threadsafe(self.fail_here, request_id, error)

    def fail_here(self, request_id: str, error: BaseException) -> None:
        self._push(request_id, TokenDelta([], None, None, error=f"{type(error).__name__}: {error}",
                                          kv_lost=isinstance(error, KVTransferError)))

    def _push(self, request_id: str, delta: TokenDelta) -> None:
        self._pending.setdefault(request_id, []).append(delta)
        if delta.is_last:
            self.request_ids.discard(request_id)
        self._ready.set()

    async def next_item(self) -> list[tuple[str, TokenDelta]] | None:
        """Wait for news, then take all of it: one (request id, delta) per request that advanced;
        None once the channel is closed."""
        await self._ready.wait()
        if self.closed:
            return None
        self._ready.clear()
        pending, self._pending = self._pending, {}
        return [(rid, TokenDelta.merge(deltas)) for rid, deltas in pending.items()]
