"""How much one maximal request stalls the router's other work: `/health` latency and the gaps
between other streams' tokens while the router parses, tokenizes, renders or answers it.

Setup: the real router app on uvicorn in a process of its own, in front of stand-in workers
(`tests/router_stand_in.py`: no Ray, no model) whose streams pace one token every
`--token-interval` seconds, so a gap beyond the pacing is time the router's event loop was held.
This process is the client: `--streams` streamed completions (`benchmarks.sse_client`) and a
`/health` probe every 5 ms run throughout; after 0.5 s of baseline, a third process sends one
maximal request:

- `text`: a 3.7 MB text prompt (in the 4 MiB cap; ~465k tokens, refused for length once tokenized)
- `ids`: a ~3.9 MB prompt of 900,000 token ids (JSON parse and validation; refused for length)
- `chat`: a 3.7 MB chat message (template rendering and tokenization; refused for length)
- `chunked`: a 24 MiB body with Transfer-Encoding: chunked (413 once the cap is crossed)
- `echo`: a 60,000-token prompt scored with echo + logprobs 5 (detokenizing, logprob formatting, JSON)

Each runs twice, side by side: `threads` (the router's CPU threads, as served) and `inline` (the
same work on the event loop, as the router did before). Reported: the maximal request's status and
seconds; the worst `/health` latency and the worst stream gap beyond the pacing ("stall"), in the
baseline and while the request was in the router.

    python -m benchmarks.boundary_stalls [--streams 4] [--token-interval 0.01] [--scenarios text,ids,...] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from benchmarks.report import environment, format_table, write_results
from benchmarks.sse_client import SSEClient

SCENARIOS = ("text", "ids", "chat", "chunked", "echo")
TEXT = ("The quick brown fox jumps over the lazy dog. " * 90_000)[:3_700_000]
MAX_MODEL_LEN = 65_536


# -- the router process ------------------------------------------------------------------------------

def serve(mode: str, port: int, interval: float) -> None:
    import uvicorn

    from benchmarks import router_stand_in as stand_in
    from router.app import create_app
    from services.protocol import TokenDelta

    class PacedOrchestrator(stand_in.StandInOrchestrator):
        """Streams one token per `interval`; a one-token request (the scored prompt) answers at once,
        with six logprobs per prompt token (made in a thread: a worker makes them in its own process)."""

        async def generate(self, request_id, prompt_token_ids, params):
            if params.max_tokens == 1:
                top = await asyncio.to_thread(
                    lambda: [{(t + k) % self.vocab_size: -0.5 - k for k in range(6)} for t in prompt_token_ids[1:]])
                logprobs = None if params.logprobs is None else [{1: -1.0}]
                yield TokenDelta([1], logprobs, "length", prompt_logprobs=top if params.prompt_logprobs else None)
                return
            for i in range(params.max_tokens):
                await asyncio.sleep(interval)
                yield TokenDelta([65 + i % 26], None, "length" if i == params.max_tokens - 1 else None)

    class InlinePool:
        """The CPU work on the event loop itself (how the router ran it before its CPU threads)."""

        max_threads = 0

        async def run(self, func, *args, **kwargs):
            return func(*args, **kwargs)

        def shutdown(self) -> None:
            pass

    tokenizer = stand_in.tokenizer()
    options = {"cpu": InlinePool()} if mode == "inline" else {}
    state = stand_in.state(tokenizer, PacedOrchestrator(tokenizer.vocab_size), MAX_MODEL_LEN, **options)
    uvicorn.run(create_app(state), host="127.0.0.1", port=port, log_level="warning")


# -- the client --------------------------------------------------------------------------------------

def request_body(scenario: str) -> tuple[str, bytes]:
    """The path and (JSON) body of `scenario`'s maximal request, encoded before the measurement."""
    if scenario == "text":
        return "/v1/completions", _json({"prompt": TEXT, "max_tokens": 1})
    if scenario == "ids":
        return "/v1/completions", _json({"prompt": [i % 500 for i in range(900_000)], "max_tokens": 1})
    if scenario == "chat":
        return "/v1/chat/completions", _json({"messages": [{"role": "user", "content": TEXT}], "max_tokens": 1})
    if scenario == "echo":
        return "/v1/completions", _json({"prompt": [5 + i % 400 for i in range(60_000)], "echo": True,
                                         "logprobs": 5, "max_tokens": 1})
    return "/v1/completions", b"x" * 65536  # chunked: this chunk, 384 times (24 MiB)


def _json(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def send(url: str, scenario: str) -> None:
    """The sender process: encode the maximal request, say "ready", send it on "go", then print
    when it started and ended (perf_counter is CLOCK_MONOTONIC, the same clock in every process) and
    its status. A process of its own: building, sending and reading it must not take the GIL from
    the client that times /health and the streams."""
    path, body = request_body(scenario)
    print("ready", flush=True)
    sys.stdin.readline()
    with httpx.Client(base_url=url, timeout=120) as http:
        start = time.perf_counter()
        try:
            if scenario == "chunked":
                status = str(http.post(path, content=(body for _ in range(384))).status_code)
            else:
                status = str(http.post(path, content=body, headers={"content-type": "application/json"}).status_code)
        except httpx.TransportError as error:  # the router closed the connection mid-upload
            status = f"closed ({type(error).__name__})"
        print(json.dumps({"start": start, "end": time.perf_counter(), "status": status}), flush=True)


async def measure(url: str, scenario: str, num_streams: int, interval: float) -> dict:
    stop = asyncio.Event()
    probes: list[tuple[float, float]] = []  # (sent, answered)

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while not stop.is_set():
                sent = time.perf_counter()
                await http.get("/health")
                probes.append((sent, time.perf_counter()))
                await asyncio.sleep(0.005)

    clients = [SSEClient(url) for _ in range(num_streams)]
    arrivals: list[list[float]] = [[] for _ in clients]
    body = {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 8, "stream": True}
    streams = [asyncio.create_task(c.post_stream("/v1/completions", body, f"stream-{i}", arrivals[i]))
               for i, c in enumerate(clients)]
    sender = subprocess.Popen([sys.executable, "-m", "benchmarks.boundary_stalls", "--send", scenario, "--url", url],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert await asyncio.to_thread(sender.stdout.readline) == "ready\n"
    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.5)  # baseline
    sender.stdin.write("go\n")
    sender.stdin.flush()
    sent = json.loads(await asyncio.to_thread(sender.stdout.readline))
    await asyncio.to_thread(sender.wait, 30)  # it exits: not on this loop, which times the streams
    start, end, status = sent["start"], sent["end"], sent["status"]
    await asyncio.sleep(1.0)  # a stall may outlast the request's answer (freeing what it built)
    stop.set()
    await prober
    for task, client in zip(streams, clients):
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if client.writer is not None:
            client.writer.close()

    def worst(lo: float, hi: float, within: bool) -> tuple[float, float]:
        """The longest /health wait and stream gap within [lo, hi], or (not `within`) overlapping it."""
        def counts(a: float, b: float) -> bool:
            return lo <= a and b <= hi if within else a < hi and b > lo

        health = max((b - a for a, b in probes if counts(a, b)), default=0.0)
        gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if counts(a, b)]
        return health * 1e3, max(0.0, max(gaps, default=interval) - interval) * 1e3

    base_health, base_stall = worst(start - 0.5, start, within=True)
    health, stall = worst(start, end, within=False)
    return {"scenario": scenario, "status": status, "seconds": end - start, "health_ms_baseline": base_health,
            "health_ms": health, "stall_ms_baseline": base_stall, "stall_ms": stall,
            "tokens_streamed": sum(len(a) for a in arrivals)}


def run_mode(mode: str, scenarios: list[str], repeats: int, num_streams: int, interval: float) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.boundary_stalls", "--serve", mode, "--port", str(port),
                               "--token-interval", str(interval)], env=os.environ | {"PYTHONPATH": os.getcwd()})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the router did not start")
            time.sleep(0.1)
        return [{"mode": mode, **asyncio.run(measure(url, s, num_streams, interval))}
                for _ in range(repeats) for s in scenarios]
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--token-interval", type=float, default=0.01)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--modes", default="threads,inline")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each; the table shows their medians")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--send", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.port, args.token_interval)
    if args.send:
        return send(args.url, args.send)
    scenarios = [s for s in args.scenarios.split(",") if s]
    load = os.getloadavg()[0]
    results = [r for mode in args.modes.split(",")
               for r in run_mode(mode, scenarios, args.repeats, args.streams, args.token_interval)]
    header = ["scenario", "mode", "status", "request s", "/health ms (base)", "/health ms", "stall ms (base)", "stall ms"]
    keys = ["seconds", "health_ms_baseline", "health_ms", "stall_ms_baseline", "stall_ms"]
    rows = []
    for scenario in scenarios:
        for mode in args.modes.split(","):
            runs = [r for r in results if r["scenario"] == scenario and r["mode"] == mode]
            rows.append([scenario, mode, "/".join(sorted({r["status"] for r in runs}))]
                        + [statistics.median(r[k] for r in runs) for k in keys])
    print(f"{args.streams} streams paced at {args.token_interval * 1e3:g} ms/token; worst /health latency and worst "
          f"stream gap beyond the pacing, in the 0.5 s baseline and while the maximal request was in the router "
          f"(median of {args.repeats}); load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(format_table(header, rows))
    payload = {"environment": environment(), "streams": args.streams, "token_interval": args.token_interval,
               "load_average": [load, os.getloadavg()[0]], "results": results}
    print(f"wrote {write_results('boundary_stalls', payload)}")


if __name__ == "__main__":
    main()
