"""This router's one token stream from one decode worker, fanned out to its requests.

The worker's `channel` generator yields, per engine step, the new tokens of every request this
router has on it (why one stream and not one per request: `decode_worker/output_channel.py`). A
pump task reads it and hands each request its deltas; a request that reads slowly gets the deltas
that piled up merged into one. If the stream fails (the worker died), every request on it fails.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import ray

from services.protocol import TokenDelta

log = logging.getLogger("pdserve.router")


class WorkerFailed(RuntimeError):
    """The decode worker failed a request, or its stream broke."""


class KVLost(WorkerFailed):
    """The worker could not use the request's KV (not fetched, or not verified): the prompt can be
    recomputed from its tokens."""


class WorkerLost(WorkerFailed):
    """The stream from the worker broke (the worker died or cannot be reached): every request on it
    can be resumed elsewhere."""


class ChannelClosed(WorkerLost):
    """The worker ended the stream itself (its lease on this channel ran out): the worker is alive,
    and the requests can be resumed anywhere, there included."""


class RequestDeltas:
    """One request's deltas as they arrive; `get` returns everything that arrived since the last."""

    def __init__(self) -> None:
        self._pending: list[TokenDelta] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def push(self, delta: TokenDelta) -> None:
        self._pending.append(delta)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> TokenDelta:
        await self._ready.wait()
        if not self._pending:
            raise self._error
        pending, self._pending = self._pending, []
        if self._error is None:
            self._ready.clear()
        return TokenDelta.merge(pending)


class DecodeChannel:
    def __init__(self, name: str, actor, router_id: str | None = None) -> None:
        self.name = name
        self.actor = actor
        self.channel_id = f"{router_id or uuid.uuid4().hex}/{name}"
        self._requests: dict[str, RequestDeltas] = {}
        self._pump: asyncio.Task | None = None
        self._stream = None

    def open(self, request_id: str) -> RequestDeltas:
        """Register a request before it is admitted, so none of its deltas can be missed."""
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        deltas = self._requests[request_id] = RequestDeltas()
        return deltas

    def close(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    async def _run(self) -> None:
        self._stream = self.actor.channel.remote(self.channel_id)
        try:
            async for ref in self._stream:
                for request_id, delta in await ref:
                    deltas = self._requests.get(request_id)
                    if deltas is not None:  # else: closed here already (client gone), abort on its way
                        deltas.push(delta)
                        if delta.is_last:
                            del self._requests[request_id]
            raise ChannelClosed(f"{self.name}: the worker closed the token stream")
        except Exception as error:
            log.warning("decode channel to %s failed: %s", self.name, error)
            failure = error if isinstance(error, WorkerLost) else WorkerLost(f"{self.name}: {error}")
            requests, self._requests = self._requests, {}
            for deltas in requests.values():
                deltas.fail(failure)
        finally:
            self._stream = None

    def fail_open(self, reason: str) -> None:
        """End every request still reading here with WorkerLost (their streams resume elsewhere)."""
        requests, self._requests = self._requests, {}
        for deltas in requests.values():
            deltas.fail(WorkerLost(f"{self.name}: {reason}"))

    def shutdown(self) -> None:
        """Stop reading; the worker then aborts whatever this router still had running there."""
        if self._stream is not None:
            ray.cancel(self._stream)
        if self._pump is not None:
            self._pump.cancel()
