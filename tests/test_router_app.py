"""The real router app in front of stand-in workers (`router_stand_in.py`): heavy CPU work off the
event loop, a chunked body over the cap on a real server, the API key on the real routes, the error
bodies, and an OpenAPI document that says what the server answers."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
import router_stand_in as stand_in

from router.app import create_app


class HeldTokenizer:
    """The stand-in's tokenizer, except that `held` (encoding a long text, or naming a token for
    logprobs) waits for `release`: a test's way to keep a request in that work as long as it needs."""

    def __init__(self, held: str) -> None:
        self.inner, self.held = stand_in.tokenizer(), held
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.held == "encode" and len(text) > 10_000:
            self._hold()
        return self.inner.encode(text, add_special_tokens)

    def token_text(self, token_id: int) -> str:
        if self.held == "token_text":
            self._hold()
        return self.inner.token_text(token_id)

    def _hold(self) -> None:
        self.entered.set()
        self.release.wait(60)


@pytest.mark.parametrize("held, body, status", [
    ("encode", {"prompt": "many words " * 100_000}, 400),  # a large prompt being tokenized
    ("token_text", {"prompt": "many words " * 20, "echo": True, "logprobs": 1, "max_tokens": 2}, 200),  # formatted
])
def test_health_answers_while_a_request_is_in_heavy_cpu_work(held, body, status):
    tokenizer = HeldTokenizer(held)
    with stand_in.served(stand_in.state(tokenizer)) as url, ThreadPoolExecutor(1) as client:
        heavy = client.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
        assert tokenizer.entered.wait(30)
        try:
            # Were the held work on the event loop, /health would wait for it too: this would time out.
            health = httpx.get(url + "/health", timeout=10)
        finally:
            tokenizer.release.set()
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert heavy.result().status_code == status


def test_a_chunked_body_over_the_cap_gets_413_from_the_server_which_closes_the_connection():
    with stand_in.served(stand_in.state(max_body_bytes=65536)) as url:
        address = urlparse(url)
        sock = socket.create_connection((address.hostname, address.port))
        answer = bytearray()

        def read() -> None:
            try:
                while chunk := sock.recv(65536):
                    answer.extend(chunk)
            except ConnectionResetError:  # the server closed with body unread: a reset, after its answer
                pass

        reader = threading.Thread(target=read)
        reader.start()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        sent, closed = 0, False
        try:
            for _ in range(384):  # 24 MiB
                sock.sendall(chunk)
                sent += 65536
        except OSError:  # the server closed the connection
            closed = True
        reader.join(timeout=30)
        sock.close()
    head, _, body = bytes(answer).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    assert json.loads(body)["error"]["type"] == "RequestTooLargeError"
    assert closed and sent < 24 * 2**20  # refused mid-body, not after reading all of it


def request(method: str, path: str, router_state=None, **kwargs) -> httpx.Response:
    async def run():
        app = create_app(router_state or stand_in.state())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            return await http.request(method, path, **kwargs)

    return asyncio.run(run())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_malformed_json_is_a_400_that_blames_no_field(path):
    answer = request("POST", path, content=b'{"prompt": "x", ', headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"] == {"message": "request body is not valid JSON (at character 16)",
                                      "type": "BadRequestError", "param": None, "code": 400}


@pytest.mark.parametrize("method, path, allowed", [("GET", "/v1/completions", "POST"), ("DELETE", "/tokenize", "POST"),
                                                   ("POST", "/health", "GET"), ("PUT", "/v1/models", "GET")])
def test_a_wrong_method_is_405_with_allow(method, path, allowed):
    answer = request(method, path)
    assert answer.status_code == 405 and answer.headers["allow"] == allowed
    assert answer.json()["error"]["type"] == "MethodNotAllowedError"


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/metrics", "/v1/models"])
def test_the_real_routes_need_the_key(path):
    router_state = stand_in.state(api_key="k3y")
    assert request("GET", path, router_state).status_code == 401
    assert request("GET", path, router_state, headers={"authorization": "Bearer k3y"}).status_code == 200
    assert request("GET", "/health", router_state).status_code == 200


def test_the_openapi_document_lists_the_answers_the_server_gives():
    doc = request("GET", "/openapi.json").json()
    assert "422" not in json.dumps(doc) and "HTTPValidationError" not in doc["components"]["schemas"]
    completions = doc["paths"]["/v1/completions"]["post"]
    assert sorted(completions["responses"]) == ["200", "400", "404", "413", "429", "503", "504"]
    assert sorted(completions["responses"]["200"]["content"]) == ["application/json", "text/event-stream"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]
    error = completions["responses"]["429"]
    assert error["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert error["headers"]["Retry-After"]["required"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert sorted(doc["paths"]["/health"]["get"]["responses"]) == ["200", "503"]
    assert "securitySchemes" not in doc["components"]  # no key configured, no 401 documented
    assert all("401" not in op["responses"] for ops in doc["paths"].values() for op in ops.values())

    keyed = request("GET", "/openapi.json", stand_in.state(api_key="k3y", metrics_without_key=True),
                    headers={"authorization": "Bearer k3y"}).json()
    assert "401" in keyed["paths"]["/tokenize"]["post"]["responses"]
    assert "401" not in keyed["paths"]["/health"]["get"]["responses"]
    assert "401" not in keyed["paths"]["/metrics"]["get"]["responses"]


def test_a_stuck_worker_lookup_holds_neither_the_event_loop_nor_the_exit():
    # The control store's list call blocked forever once the raylet died (SIGTERM to the process group): made on
    # the event loop it froze every request and uvicorn's shutdown. Off the loop, on a daemon thread, the loop
    # runs on, the poller gives up after its timeout, and the thread cannot hold the interpreter's exit.
    from router.app import on_daemon_thread

    never = threading.Event()
    started = []

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(on_daemon_thread(lambda: started.append(1) or never.wait()), 0.2)
        ticker.cancel()
        assert await on_daemon_thread(lambda: 7) == 7
        with pytest.raises(ZeroDivisionError):
            await on_daemon_thread(lambda: 1 / 0)
        return ticks

    assert asyncio.run(main()) > 10  # the loop ran while the lookup was stuck
    assert started == [1]
    stuck = [t for t in threading.enumerate() if t.name == "pdserve-lookup" and t.is_alive()]
    assert stuck and all(t.daemon for t in stuck)
    never.set()
