"""The router's boundary middleware on its own (a stand-in app behind it): API key, body cap, and
the in-flight cap that refuses at once with 429 + Retry-After instead of queueing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from router.app import BoundaryMiddleware
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
    options = dict(api_key=None, max_body_bytes=1000, max_pending=None) | state
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


@pytest.mark.parametrize("given, status", [(None, 401), ("Bearer wrong", 401), ("Bearer k3y", 200)])
def test_api_key_is_required_on_the_api_routes_only(given, status):
    async def run():
        app = HeldApp()
        app.release.set()
        async with client(app, api_key="k3y") as http:
            headers = {"authorization": given} if given else {}
            answer = await http.post("/v1/completions", json={}, headers=headers)
            assert answer.status_code == status
            if status == 401:
                assert answer.json()["error"]["type"] == "AuthenticationError"
            assert (await http.get("/health")).status_code == 200

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
