"""Runs an Engine's step loop in a background thread and gives each request an asyncio stream.

A Ray actor's event loop must stay free to accept calls while the model computes, so the engine
steps in its own thread; requests and aborts reach it through a queue, and outputs come back to
the event loop with `call_soon_threadsafe`. Outputs go to a sink per request: its own
`RequestStream` by default, or one shared by many requests (the decode worker's per-router channel).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from services.request_output import StepOutput

if TYPE_CHECKING:
    from services.engine import Engine


class OutputSink(Protocol):
    """Where a request's outputs go. `deliver` runs on `loop`; `fail` may be called from any thread."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, out: StepOutput) -> None: ...

    def fail(self, request_id: str, error: BaseException) -> None: ...


class RequestStream:
    """The outputs of one request, read on the event loop that submitted it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()

    def deliver(self, out: StepOutput) -> None:
        self.queue.put_nowait(out)

    def fail(self, request_id: str, error: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, error)

    async def next_batch(self) -> list[StepOutput]:
        """Wait for at least one output, then take every one already waiting (a lagging reader
        gets several steps' tokens at once)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items


def _deliver(items: list[tuple[OutputSink, StepOutput]]) -> None:
    for sink, out in items:
        sink.deliver(out)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, str, Callable[[Engine], None] | None]] = queue.SimpleQueue()
        self._streams: dict[str, OutputSink] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopped = False
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, add: Callable[[Engine], None], sink: OutputSink | None = None) -> OutputSink:
        """Queue `add(engine)` (which adds the request) on the engine thread; its outputs go to
        `sink`, by default a new RequestStream, which is returned."""
        stream = sink or RequestStream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already running here")
            self._streams[request_id] = stream
        self._commands.put(("add", request_id, add))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self._commands.put(("abort", request_id, None))
            self._wakeup.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished_requests:
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # an internal fault: fail every request rather than hang them
                self._fail_all(error)
                continue
            self.num_steps += 1
            deliveries: dict[asyncio.AbstractEventLoop, list[tuple[OutputSink, StepOutput]]] = {}
            with self._lock:
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None and out.finish_reason is not None:
                        del self._streams[out.request_id]
                    if stream is not None and out.error is not None:
                        stream.fail(out.request_id, out.error)
                    elif stream is not None:
                        deliveries.setdefault(stream.loop, []).append((stream, out))
            for loop, items in deliveries.items():  # one wake-up per loop per step, not per request
                loop.call_soon_threadsafe(_deliver, items)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, request_id, add = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(request_id)
                continue
            try:
                add(self.engine)
            except Exception as error:  # bad input: this request fails, the others go on
                with self._lock:
                    stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.fail(request_id, error)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.engine.abort(request_id)
            stream.fail(request_id, error)
