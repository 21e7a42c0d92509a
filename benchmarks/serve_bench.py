"""The load loop of `pdserve bench`: requests sent at Poisson (or gamma, `burstiness`) arrival times,
at most `max_concurrency` in flight, each streamed and timed (`serve_request`), then the figures
(`serve_metrics`) in a result dict with vLLM's `bench serve` keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np

from benchmarks.serve_dataset import SampleRequest
from benchmarks.serve_metrics import calculate_metrics, output_len
from benchmarks.serve_request import RequestOutput, request_body, send


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # 1: Poisson; < 1 burstier, > 1 more regular (gamma-distributed gaps)
    max_concurrency: int | None = None
    seed: int = 0
    goodput: dict[str, float] | None = None  # objectives in ms: ttft, tpot, e2el
    percentiles: tuple[float, ...] = (50, 90, 99)
    ignore_eos: bool = False
    timeout_s: float = 600.0  # a request with no byte for this long fails
    progress: bool = True

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def arrival_offsets(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: gamma-distributed gaps of mean 1/rate
    (shape `burstiness`; exponential, i.e. Poisson arrivals, at 1), scaled so the last is sent at
    num_requests / rate, as vLLM does (the raw sum of random gaps misses it by a few percent)."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    return list(times * (num_requests / rate / times[-1]))


async def first_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """The first model `/v1/models` lists (vLLM's default for `--model`)."""
    try:
        response = await client.get(f"{base_url}/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise RuntimeError(f"could not read the model name from {base_url}/v1/models ({error}); "
                           "pass --model") from None


async def run(requests: list[SampleRequest], config: BenchConfig) -> dict:
    """Send every request on its schedule; the result dict (vLLM's keys, plus the per-request lists)."""
    if not requests:
        raise ValueError("no requests to send (--num-prompts must be at least 1)")
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    timeout = httpx.Timeout(config.timeout_s, connect=min(10.0, config.timeout_s))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = config.model or await first_model(client, config.base_url, config.headers)
        url = config.base_url + config.endpoint
        bodies = [request_body(config.endpoint, model, r.prompt, r.expected_output_len, config.ignore_eos)
                  for r in requests]
        test = await send(client, url, bodies[0], requests[0].prompt_len, config.headers)
        if not test.success:
            raise RuntimeError(f"the test request to {url} failed: {test.error}")
        semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
        bar = _progress(len(requests), config.progress)

        async def one(body: dict, prompt_len: int) -> RequestOutput:
            async with semaphore:
                out = await send(client, url, body, prompt_len, config.headers)
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for request, body, offset in zip(requests, bodies, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(body, request.prompt_len)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    metrics = calculate_metrics(outputs, duration, config.goodput, config.percentiles)
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if config.endpoint.endswith("chat/completions") else "openai",
        "base_url": config.base_url, "endpoint": config.endpoint, "model_id": model,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness, "max_concurrency": config.max_concurrency,
        "goodput": config.goodput,
        **metrics,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [output_len(o) if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "e2els": [o.latency for o in outputs], "errors": [o.error for o in outputs],
    }


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, unit="req", dynamic_ncols=True)


def summary(result: dict) -> str:
    """vLLM's printed summary, in its words."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(name: str, value) -> None:
        lines.append(f"{name:<44} {value:.2f}" if isinstance(value, float) else f"{name:<44} {value}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Request rate configured (RPS):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for metric, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^60}")
        for key, value in result.items():
            if key.endswith(f"_{metric}_ms") and not key.startswith("std"):
                label = key.removesuffix(f"_{metric}_ms")
                label = label.capitalize() if label in ("mean", "median") else label.upper()
                row(f"{label} {metric.upper()} (ms):", value)
    lines.append("=" * 60)
    return "\n".join(lines)
