"""The router's HTTP boundary: the middleware on its own (a stand-in app behind it: API key, body cap,
the in-flight cap that refuses at once with 429 + Retry-After instead of queueing), and the real app
in front of stand-in workers (`router_stand_in.py`): the key on every route, chunked bodies over the
cap, CPU work off the event loop, errors and the OpenAPI document."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from router.boundary import BoundaryMiddleware
from services.metrics import METRICS


class HeldApp:
    """Answers 200 to every request, but holds each completion until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"].startswith("/v1/"):
            self.entered += 1
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def client(app, **state) -> httpx.AsyncClient:
    options = dict(api_key=None, metrics_without_key=False, max_body_bytes=1000, max_pending=None) | state
    middleware = BoundaryMiddleware(app, SimpleNamespace(**options))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://router")


def refused(name: str) -> float:
    return METRICS.registry.get_sample_value("pdserve:requests_refused_total", {"reason": name}) or 0.0


def test_in_flight_cap_refuses_at_once_with_retry_after_and_frees_on_finish():
    async def run():
        app = HeldApp()
        async with client(app, max_pending=2) as http:
            held = [asyncio.create_task(http.post(path, json={})) for path in ("/v1/completions", "/v1/chat/completions")]
            while app.entered < 2:
                await asyncio.sleep(0.01)
            before = refused("too_many_pending")
            third = await http.post("/v1/completions", json={})
            assert third.status_code == 429 and third.headers["retry-after"] == "1"
            body = third.json()["error"]
            assert body["type"] == "RateLimitError" and body["code"] == 429
            assert body["message"] == ("2 requests are in flight through this router, its limit (--max-pending 2); "
                                       "retry shortly")
            assert refused("too_many_pending") == before + 1
            assert (await http.get("/health")).status_code == 200  # only completions count
            app.release.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
            assert (await http.post("/v1/completions", json={})).status_code == 200  # room again

    asyncio.run(run())


def test_body_over_the_cap_is_413_before_the_app_sees_it():
    async def run():
        app = HeldApp()
        app.release.set()
        async with client(app) as http:
            answer = await http.post("/v1/completions", content=b"x" * 1001)
            assert answer.status_code == 413 and answer.json()["error"]["code"] == 413
            assert app.entered == 0
            assert answer.headers["x-request-id"]  # every answer carries its request id

    asyncio.run(run())


class BodyReader:
    """Reads the whole body, as FastAPI does before a route runs, then answers 400 (as the router
    did for a 24 MB chunked body it had read and tokenized)."""

    def __init__(self) -> None:
        self.body_bytes = 0

    async def __call__(self, scope, receive, send) -> None:
        while True:
            message = await receive()
            self.body_bytes += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"not JSON"})


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_chunked_body_over_the_cap_is_413_as_soon_as_it_crosses_it(path):
    async def run():
        app = BodyReader()
        pulled = 0

        async def chunks():  # no Content-Length: sent with Transfer-Encoding: chunked
            nonlocal pulled
            for _ in range(1000):  # 100,000 bytes against a cap of 1,000
                pulled += 1
                yield b"x" * 100

        async with client(app) as http:
            answer = await http.post(path, content=chunks())
        assert answer.status_code == 413
        assert answer.json()["error"] == {"message": "request body is larger than 1000 bytes",
                                          "type": "RequestTooLargeError", "param": None, "code": 413}
        assert answer.headers["connection"] == "close"  # the server reads no more of it
        assert answer.headers["x-request-id"]
        assert app.body_bytes <= 1000  # the app never got the read that crossed the cap
        assert pulled <= 12  # 11 chunks cross the cap; the client may have one more ready

    asyncio.run(run())


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
                                          ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/metrics"),
                                          ("GET", "/no-such-route")])
@pytest.mark.parametrize("given", [None, "Bearer wrong", "k3y", "Bearer k3y "])
def test_with_an_api_key_every_route_but_health_needs_it(method, path, given):
    async def run():
        app = HeldApp()
        app.release.set()
        async with client(app, api_key="k3y") as http:
            headers = {"authorization": given} if given else {}
            answer = await http.request(method, path, headers=headers)
            assert answer.status_code == 401
            assert answer.json()["error"] == {"message": "Invalid or missing API key.", "type": "AuthenticationError",
                                              "param": None, "code": 401}
            assert (await http.request(method, path, headers={"authorization": "Bearer k3y"})).status_code == 200
            assert (await http.get("/health")).status_code == 200

    asyncio.run(run())


def test_metrics_can_be_opened_to_scrapers_without_the_key():
    async def run():
        app = HeldApp()
        app.release.set()
        async with client(app, api_key="k3y", metrics_without_key=True) as http:
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.post("/tokenize")).status_code == 401  # only /metrics opens

    asyncio.run(run())
