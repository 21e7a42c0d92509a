"""The router's FastAPI app: routes, request ids, auth, body limits, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import completions
from router.choice_runner import refuse_past_deadline
from router.errors import APIError, install_error_handlers
from router.orchestrator import Orchestrator
from router.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from router.worker_pool import WorkerPool
from services.metrics import METRICS
from services.tokenizer import Tokenizer

log = logging.getLogger("pdserve.router")


@dataclass
class RouterState:
    """Everything a request handler needs."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    pool: WorkerPool
    orchestrator: Orchestrator
    api_key: str | None = None
    max_n: int = 16
    max_body_bytes: int = 4 * 2**20
    max_pending: int | None = 1024  # completions in flight through this router; beyond it, 429
    request_timeout: float | None = None  # seconds a completion may take; past it, 504 (None: no limit)
    stats_interval: float = 1.0


def create_app(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        poller = asyncio.create_task(_poll_workers(state))
        yield
        poller.cancel()
        state.orchestrator.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app)

    app.add_middleware(BoundaryMiddleware, state=state)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        prep = completions.prepare_completion(state, body, request.state.request_id)
        return await _respond(state, prep, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        prep = completions.prepare_chat(state, body, request.state.request_id)
        return await _respond(state, prep, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return completions.tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return completions.detokenize(state, body)

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


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class BoundaryMiddleware:
    """Request ids, API key, body-size limit and the in-flight cap, as plain ASGI middleware
    (Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers).

    The cap counts a completion from its arrival until its response (or stream) ends; one more is
    refused at once with 429 and `Retry-After` rather than queued behind work it cannot overtake."""

    def __init__(self, app, state: RouterState) -> None:
        self.app, self.state = app, state
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or completions.new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        error = self._refusal(scope["path"], headers)
        if error is not None:
            return await error.response()(scope, receive, send_with_id)
        if scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send_with_id)
        limit = self.state.max_pending
        if limit is not None and self.in_flight >= limit:
            METRICS.requests_refused.labels(reason="too_many_pending").inc()
            error = APIError(429, f"{self.in_flight} requests are in flight through this router, its limit "
                                  f"(--max-pending {limit}); retry shortly", retry_after=1)
            return await error.response()(scope, receive, send_with_id)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.in_flight -= 1

    def _refusal(self, path: str, headers: dict[str, str]) -> APIError | None:
        if path.startswith("/v1/") and self.state.api_key is not None:
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.state.api_key}".encode()):
                return APIError(401, "Invalid or missing API key.")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.state.max_body_bytes:
            return APIError(413, f"request body is larger than {self.state.max_body_bytes} bytes")
        return None


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
        if done:
            return task.result()
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


async def _poll_workers(state: RouterState) -> None:
    """Renew this router's channels; refresh load and health; copy the workers' counters into the
    metrics."""
    polls = 0
    while True:
        started = time.perf_counter()
        if polls % 5 == 4:  # workers `pdserve scale` added or removed since
            try:
                for name in state.pool.discover():
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
