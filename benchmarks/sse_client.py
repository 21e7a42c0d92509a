"""A minimal HTTP/1.1 client for streamed completions, for load generation on a small host.

The benchmarks run the client on the same cores as the router and workers, so the client's own CPU
per token is taken from what the system under test gets. httpx spends about 0.1 ms of CPU per
streamed token on parsing; this client reads the chunked SSE body with asyncio streams, keeps the
connection alive, and decodes only the JSON it needs (the first chunk's time and the final usage).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from urllib.parse import urlsplit


class SSEClient:
    """One keep-alive connection; `post_stream` sends one streamed request at a time."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_stream(self, path: str, body: dict, request_id: str, arrivals: list | None = None) -> dict:
        """Send the request; read the SSE stream to [DONE]. Returns the times of sending and of the
        first data event, the number of data events, and the final usage (if the server sent it).
        With `arrivals`, each data event's arrival time is appended to it."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nX-Request-Id: {request_id}\r\n\r\n").encode()
        sent = time.perf_counter()
        self.writer.write(head + payload)
        status = await self.reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP status {status!r}")
        while (await self.reader.readline()) not in (b"\r\n", b""):
            pass  # headers: the router always answers a stream with chunked transfer encoding
        first, events, usage, buffer = None, 0, None, b""
        while True:
            size = int((await self.reader.readline()).split(b";")[0], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            buffer += data[:-2]
            *complete, buffer = buffer.split(b"\n\n")
            for event in complete:
                if not event.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                first = first or now
                events += 1
                if arrivals is not None and b'"choices": []' not in event:  # not the usage-only event
                    arrivals.append(now)
                if b'"usage"' in event:
                    usage = json.loads(event[6:]).get("usage") or usage
        return {"sent": sent, "first": first, "events": events, "usage": usage}

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


def run_client_process(module: str, job: dict) -> dict:
    """`module._client(job)` in a fresh Python process (so the load client never shares the
    router's GIL or cores' accounting); its JSON result."""
    code = f"import sys, json; from {module} import _client; print(json.dumps(_client(json.load(sys.stdin))))"
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)

