"""Disaggregated vs colocated on the same cores: what a long prefill does to the running streams.

Why pdserve exists, measured. A prompt's prefill is one big compute-bound step; on a worker that
also decodes, every running stream waits for it (vLLM's chunked prefill bounds the wait by the
chunk, it does not remove it). With the phases on different workers, the streams never wait for a
prefill; what crosses over is the KV copy into the decode worker's pool.

Method. One local Ray instance on this host; each topology in turn gets the same two worker
processes, each pinned to its own core(s) with one torch thread, behind the same router (in this
process), driven by the same client (its own process, `benchmarks.sse_client`):
  disaggregated: 1 prefill + 1 decode worker;   colocated: 2 workers that each prefill and decode;
  disaggregated, auto: the first, with the router's cost model choosing per prompt whether its decode
  worker prefills it (`--local-prefill-tokens auto`; measured after the warm-up).
Workload: `--streams` streams (`--stream-prompt-tokens`-token prompts, `--stream-tokens` output
tokens, EOS ignored) start together; from `--long-start` s on, `--long-prompts` requests of
`--long-prompt-tokens` tokens (`--long-output` tokens out) arrive one every `--long-interval` s.
Reported: the gaps between consecutive SSE events of the streams (what a reader sees as inter-token
latency; an event can carry several tokens when the router lags; the streams ask for `logprobs: 0`
so that a token whose text is held back still makes an event), the long prompts' time to first
token, and the streams' combined tokens/s. Fresh random prompts per topology (no prefix-cache hits).

    python -m benchmarks.pd_vs_colocated [--preset small] [--streams 8] [--long-prompts 4]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import ray

from benchmarks.local_cluster import serve_router
from benchmarks.model_folders import describe, preset_folder
from benchmarks.report import environment, format_table, write_results
from benchmarks.sse_client import run_client_process
from router.launcher import ClusterSpec, start_workers, stop_workers
from router.ray_instance import init_local_ray
from services.metrics import METRICS
from services.model_config import ModelConfig

OPTIONS = {"num_threads": 1, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def _client(job: dict) -> dict:
    """Runs in the client process: the streams and the long prompts, timed."""
    import asyncio

    from benchmarks.sse_client import SSEClient

    async def stream(i: int, prompt: list[int]) -> dict:
        client, arrivals = SSEClient(job["url"]), []
        # logprobs: every delta becomes an event even when its text is held back (a lone byte of a
        # multi-byte character, which random weights produce often), so the gaps time the tokens.
        body = {"prompt": prompt, "max_tokens": job["stream_tokens"], "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
        got = await client.post_stream("/v1/completions", body, f"s{i}", arrivals)
        await client.close()
        return {"arrivals": arrivals, "tokens": got["usage"]["completion_tokens"], "ttft": got["first"] - got["sent"]}

    async def long(i: int, prompt: list[int]) -> float:
        await asyncio.sleep(job["long_start"] + i * job["long_interval"])
        client = SSEClient(job["url"])
        body = {"prompt": prompt, "max_tokens": job["long_output"], "temperature": 0, "ignore_eos": True,
                "stream": True}
        got = await client.post_stream("/v1/completions", body, f"l{i}")
        await client.close()
        return got["first"] - got["sent"]

    async def run() -> dict:
        start = time.perf_counter()
        streams = asyncio.gather(*(stream(i, p) for i, p in enumerate(job["stream_prompts"])))
        longs = asyncio.gather(*(long(i, p) for i, p in enumerate(job["long_prompts"])))
        done, ttfts = await asyncio.gather(streams, longs)
        return {"streams": done, "long_ttft_s": ttfts, "start": start}

    return asyncio.run(run())


def run_client(job: dict) -> dict:
    return run_client_process("benchmarks.pd_vs_colocated", job)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(out: dict) -> dict:
    gaps = [b - a for s in out["streams"] for a, b in zip(s["arrivals"], s["arrivals"][1:])]
    ends = [s["arrivals"][-1] for s in out["streams"]]
    firsts = [s["arrivals"][0] for s in out["streams"]]
    tokens = sum(s["tokens"] for s in out["streams"])
    ttft = out["long_ttft_s"]
    return {"stream_ttft_p50_s": statistics.median(s["ttft"] for s in out["streams"]),
            "stream_ttft_max_s": max(s["ttft"] for s in out["streams"]),"itl_p50_s": quantile(gaps, 0.5), "itl_p90_s": quantile(gaps, 0.9), "itl_p99_s": quantile(gaps, 0.99),
            "itl_max_s": max(gaps), "num_gaps": len(gaps), "long_ttft_p50_s": statistics.median(ttft),
            "long_ttft_max_s": max(ttft), "stream_tokens": tokens,
            "stream_tokens_per_s": tokens / (max(ends) - min(firsts))}


def _wait_for_rates(pool, timeout: float = 10.0) -> None:
    """Until the router has polled the rates the cost model needs (a no-op for the other modes)."""
    deadline = time.monotonic() + timeout
    while pool.role("prefill") and not (pool.kv_bytes_per_second and pool.best("prefill").prefill_tokens_per_second):
        if time.monotonic() > deadline:
            raise RuntimeError("the router measured no prefill rate or KV transfer after the warm-up")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=("tiny", "small"))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt-tokens", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=120)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-prompt-tokens", type=int, default=1024)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--long-start", type=float, default=0.5, help="seconds after the streams start")
    parser.add_argument("--long-interval", type=float, default=1.0, help="seconds between long prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    folder = str(preset_folder(args.preset))
    config = ModelConfig.from_folder(folder)
    rng = random.Random(args.seed)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(4, config.vocab_size) for _ in range(length)] for _ in range(count)]

    disaggregated = dict(mode="disaggregated", num_prefill=1, num_decode=1)
    topologies = {"disaggregated": (disaggregated, 0), "colocated": (dict(mode="colocated", num_colocated=2), 0),
                  "disaggregated, auto": (disaggregated, None)}
    results = {}
    init_local_ray(ClusterSpec(model=folder, mode="colocated", num_colocated=2), num_cpus=os.cpu_count())
    try:
        for i, (name, (shape, local_prefill)) in enumerate(topologies.items()):
            spec = ClusterSpec(model=folder, namespace=f"pd-bench-{i}", engine_options=OPTIONS, **shape)
            actors = start_workers(spec, local=True)
            try:
                with serve_router(spec, local_prefill_tokens=local_prefill) as (url, state):
                    warm = {"url": url, "stream_prompts": prompts(2, 8), "long_prompts": prompts(1, 64),
                            "stream_tokens": 4, "long_output": 2, "long_start": 0.0, "long_interval": 0.0}
                    run_client(warm)
                    _wait_for_rates(state.pool)
                    local_before = METRICS.local_prefills._value.get()
                    job = {"url": url, "stream_prompts": prompts(args.streams, args.stream_prompt_tokens),
                           "long_prompts": prompts(args.long_prompts, args.long_prompt_tokens),
                           "stream_tokens": args.stream_tokens, "long_output": args.long_output,
                           "long_start": args.long_start, "long_interval": args.long_interval}
                    results[name] = summarize(run_client(job))
                    results[name]["local_prefills"] = int(METRICS.local_prefills._value.get() - local_before)
            finally:
                stop_workers(actors)
    finally:
        ray.shutdown()

    print(f"{args.preset} preset ({describe(config)}); two worker processes, one core and one torch thread each, "
          f"in both topologies; router in this process, client in its own")
    print(f"{args.streams} streams ({args.stream_prompt_tokens}-token prompts, {args.stream_tokens} tokens out) "
          f"while {args.long_prompts} prompts of {args.long_prompt_tokens} tokens arrive, one every "
          f"{args.long_interval} s\n")
    rows = [[name, 1e3 * r["itl_p50_s"], 1e3 * r["itl_p90_s"], 1e3 * r["itl_p99_s"], 1e3 * r["itl_max_s"],
             1e3 * r["stream_ttft_p50_s"], 1e3 * r["long_ttft_p50_s"], 1e3 * r["long_ttft_max_s"],
             r["stream_tokens_per_s"], r["local_prefills"] if name != "colocated" else "all"]
            for name, r in results.items()]
    print(format_table(["topology", "stream gap p50 ms", "p90", "p99", "max", "stream TTFT p50 ms",
                        "long TTFT p50 ms", "max", "stream tok/s", "local prefills"], rows))
    d, c = results["disaggregated"], results["colocated"]
    print(f"\ncolocated / disaggregated: stream gap p99 {c['itl_p99_s'] / d['itl_p99_s']:.1f}x, "
          f"max {c['itl_max_s'] / d['itl_max_s']:.1f}x; long-prompt TTFT p50 "
          f"{c['long_ttft_p50_s'] / d['long_ttft_p50_s']:.2f}x")
    path = write_results("pd_vs_colocated", {"environment": environment(), "args": vars(args),
                                             "engine_options": OPTIONS, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
