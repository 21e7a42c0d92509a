"""The router's FastAPI app: its routes, health and metrics (the boundary checks are in boundary.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import completions, daemon_thread
from router.boundary import BoundaryMiddleware
from router.choice_runner import refuse_past_deadline
from router.cpu_pool import CPUPool
from router.errors import install_error_handlers
from router.json_response import PiecewiseJSONResponse
from router.openapi import openapi_document
from router.orchestrator import Orchestrator
from router.request_body import parse
from router.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from router.worker_pool import WorkerPool
from services.metrics import METRICS
from services.tokenizer import Tokenizer

log = logging.getLogger("pdserve.router")
T = TypeVar("T")


@dataclass
class RouterState:
    """Everything a request handler needs."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    pool: WorkerPool
    orchestrator: Orchestrator
    api_key: str | None = None  # with one, every route but /health needs it
    metrics_without_key: bool = False  # /metrics open even with an api_key (--metrics-without-key)
    max_n: int = 16
    max_body_bytes: int = 4 * 2**20
    max_pending: int | None = 1024  # completions in flight through this router; beyond it, 429
    request_timeout: float | None = None  # seconds a completion may take; past it, 504 (None: no limit)
    stats_interval: float = 1.0
    cpu: CPUPool = field(default_factory=CPUPool)  # parsing, tokenizing, rendering: off the event loop


def create_app(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        poller = asyncio.create_task(_poll_workers(state))
        yield
        poller.cancel()
        state.orchestrator.shutdown()
        state.cpu.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app)
    app.add_middleware(BoundaryMiddleware, state=state)
    # The bodies are read here and parsed on the CPU threads (request_body.py), so FastAPI does not
    # see them: openapi.py documents them, with the answers the routes really give.
    app.openapi = lambda: app.openapi_schema or _document(app, state)

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        prep = await state.cpu.run(_prepared, state, CompletionRequest, completions.prepare_completion,
                                   await request.body(), request.state.request_id)
        return await _respond(state, prep, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        prep = await state.cpu.run(_prepared, state, ChatCompletionRequest, completions.prepare_chat,
                                   await request.body(), request.state.request_id)
        return await _respond(state, prep, request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await state.cpu.run(_answered, state, TokenizeRequest, completions.tokenize, await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await state.cpu.run(_answered, state, DetokenizeRequest, completions.detokenize, await request.body())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": state.max_model_len}]}

    @app.get("/health")
    async def health():
        for stats in await state.pool.poll():
            METRICS.record_worker(stats)
        if not state.pool.role("decode"):
            return JSONResponse({"status": "unhealthy", "missing": ["decode"]}, status_code=503)
        if state.orchestrator.mode == "disaggregated" and not state.pool.role("prefill"):
            # Still serving: the decode workers prefill (slower TTFT, no hand-off), so not a 503.
            return {"status": "degraded", "missing": ["prefill"]}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(METRICS.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _document(app: FastAPI, state: RouterState) -> dict:
    app.openapi_schema = openapi_document(app, api_key=state.api_key is not None,
                                          metrics_without_key=state.metrics_without_key)
    return app.openapi_schema


def _prepared(state: RouterState, model, prepare, raw: bytes, request_id: str) -> completions.Prepared:
    """On a CPU thread: the body parsed, validated, tokenized (chat: rendered) and checked."""
    return prepare(state, parse(model, raw), request_id)


def _answered(state: RouterState, model, answer, raw: bytes) -> PiecewiseJSONResponse:
    """On a CPU thread: the body parsed, the answer computed and rendered as JSON."""
    return PiecewiseJSONResponse(answer(state, parse(model, raw)))


async def _respond(state: RouterState, prep: completions.Prepared, request: Request):
    refuse_past_deadline(state, prep)  # before a stream's headers: the refusal is its HTTP status
    if prep.stream:  # Starlette cancels the stream when the client goes; that aborts the request
        # Start the request now: the prefill runs while Starlette sends the response headers.
        events = completions.stream(state, prep)
        first = asyncio.ensure_future(events.__anext__())
        return StreamingResponse(_started(first, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    # A non-streamed request has no stream to cancel: watch the connection while it runs.
    task = asyncio.create_task(completions.complete(state, prep))
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:  # the JSON of a long echo with logprobs takes a while to write: not on the loop
            return await state.cpu.run(PiecewiseJSONResponse, task.result())
        if await request.is_disconnected():
            task.cancel()  # unwinds run_choices, which cancels the workers' generators
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


async def _started(first: asyncio.Future, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, whose first item is already being computed in `first`."""
    try:
        try:
            yield await first  # cancelling this await cancels `first`, which unwinds `events`
        except StopAsyncIteration:
            return
        async for event in events:
            yield event
    finally:
        if first.done():
            await events.aclose()


LOOKUP_SECONDS = 10.0  # the longest the poller waits on the control store's list of workers


async def on_daemon_thread(fn: Callable[[], T]) -> T:
    """fn() on a daemon thread of its own, awaited (router/daemon_thread.py: for blocking Ray calls)."""
    return await asyncio.wrap_future(daemon_thread.on_daemon_thread(fn))


async def _poll_workers(state: RouterState) -> None:
    """Renew this router's channels; refresh load and health; copy the workers' counters into the
    metrics."""
    polls = 0
    while True:
        started = time.perf_counter()
        if polls % 5 == 4:  # workers `pdserve scale` added or removed since
            try:
                found = await asyncio.wait_for(on_daemon_thread(state.pool.lookup), LOOKUP_SECONDS)
                for name in state.pool.discover(found):
                    state.orchestrator.forget(name)
            except Exception as error:  # the control store did not answer: next time
                log.warning("looking up the workers failed: %r", error)
        polls += 1
        try:
            await state.orchestrator.renew_channels()
        except Exception as error:  # a worker that does not answer: its channel's own stream will tell
            log.warning("renewing decode channels failed: %r", error)
        for stats in await state.pool.poll():
            METRICS.record_worker(stats)
        for role in ("prefill", "decode"):
            METRICS.workers_alive.labels(role).set(len(state.pool.role(role)))
        wait = state.orchestrator.placement.first_token_seconds(0, state.pool.best("prefill"))
        if wait is not None:
            METRICS.prefill_wait_seconds.set(wait)
        await asyncio.sleep(max(0.0, state.stats_interval - (time.perf_counter() - started)))
