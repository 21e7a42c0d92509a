"""The router's boundary, in front of every route: request ids, the API key, the body-size cap and
the in-flight cap."""

from __future__ import annotations

import hmac

from router.completions import new_request_id
from router.errors import APIError
from services.metrics import METRICS

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)  # answered without the API key: load balancers and probes send none


class BodyTooLarge(Exception):
    """The request body grew past the cap while the app was reading it."""


class BoundaryMiddleware:
    """Request ids, API key, body-size limit and the in-flight cap, as plain ASGI middleware
    (Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers).

    With an API key, every route but /health needs it (/metrics too, unless `metrics_without_key`;
    Prometheus can send a bearer token); it is compared in constant time.

    The body cap holds however the body is framed: a declared Content-Length over it is refused
    before the app runs, and a chunked body is counted as the app reads it; the read that crosses
    the cap fails, the app's answer is replaced by the 413, and the connection is closed, so the
    rest of the body is never read.

    The in-flight cap counts a completion from its arrival until its response (or stream) ends; one
    more is refused at once with 429 and `Retry-After` rather than queued behind work it cannot
    overtake."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or new_request_id()
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
            return await self._capped(scope, receive, send_with_id)
        limit = self.state.max_pending
        if limit is not None and self.in_flight >= limit:
            METRICS.requests_refused.labels(reason="too_many_pending").inc()
            error = APIError(429, f"{self.in_flight} requests are in flight through this router, its limit "
                                  f"(--max-pending {limit}); retry shortly", retry_after=1)
            return await error.response()(scope, receive, send_with_id)
        self.in_flight += 1
        try:
            await self._capped(scope, receive, send_with_id)
        finally:
            self.in_flight -= 1

    async def _capped(self, scope, receive, send) -> None:
        """The app, reading at most `max_body_bytes` of body."""
        limit = self.state.max_body_bytes
        received, exceeded, started = 0, False, False

        async def capped_receive():
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if exceeded:  # the app's own answer to the failed read (FastAPI's would be a 400)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped_receive, guarded_send)
        except BodyTooLarge:
            pass
        if exceeded and not started:
            await _too_large(limit).response()(scope, receive, send)

    def _refusal(self, path: str, headers: dict[str, str]) -> APIError | None:
        if self.state.api_key is not None and not self._open(path):
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.state.api_key}".encode()):
                return APIError(401, "Invalid or missing API key.")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.state.max_body_bytes:
            return _too_large(self.state.max_body_bytes)
        return None

    def _open(self, path: str) -> bool:
        return path in OPEN_PATHS or (path == "/metrics" and self.state.metrics_without_key)


def _too_large(limit: int) -> APIError:
    # Connection: close makes the server drop the connection after the answer instead of reading
    # (and discarding) whatever the client still sends.
    return APIError(413, f"request body is larger than {limit} bytes", headers={"Connection": "close"})
