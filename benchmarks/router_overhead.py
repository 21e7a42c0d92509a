"""What the router adds: TTFT overhead over the prefill itself, and streamed tokens/s through one router.

Setup: the `tiny` preset (4 layers x 64, float32; a model this small makes the router, not the model,
the thing measured), a simulated two-node Ray cluster (`tests.cluster_harness.two_node_cluster`), one
PrefillWorker and one DecodeWorker (1 torch thread, max_num_seqs 128), and the router on uvicorn in a
thread of this process (`router_server`, disaggregated). The HTTP client is a separate process (so
it does not share the router's GIL) using `benchmarks.sse_client`, a minimal asyncio HTTP/1.1
client: on this small host every CPU-millisecond the load generator spends is taken from the
router and workers (httpx spent ~0.1 ms per streamed token; the client's CPU is reported). Everything shares this host's cores: the numbers
include that contention, and the CPU seconds of each process are reported with them.

(a) TTFT overhead: `--requests` sequential streamed completions (distinct ~`--prompt-tokens`-token
text prompts, max_tokens 2, temperature 0) after `--warmup` untimed ones. TTFT is the client's time
from sending to the first SSE chunk; added latency = TTFT - the prefill worker's own
`prefill_seconds` (arrival to first token on the worker, read from the router's observation of it).
perf_counter is CLOCK_MONOTONIC, shared by the processes, so the router-side marks split it into:
`front` (client send -> the orchestrator starts: HTTP, validation, tokenization), `ray` (orchestrator
start -> first token back, minus prefill_seconds: claim, actor call, result return) and `back`
(first token -> the client has the chunk: detokenize, SSE framing, socket).

(b) Throughput: `--streams` concurrent streams of `--max-tokens` tokens each (ignore_eos, temperature
0), counted at three levels in the same run, `--rounds` times interleaved: `engine` (an in-process
Engine, no Ray), `ray` (the router's Orchestrator driven from this process, no HTTP), `http` (the
client process through the router). Tokens/s = completion tokens / wall time of the whole batch.

    python -m benchmarks.router_overhead [--requests 50] [--streams 64] [--max-tokens 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from benchmarks.sse_client import run_client_process

OPTIONS = {"num_threads": 1, "max_num_seqs": 128}
WORDS = ("the quick brown fox jumps over a lazy dog while the scheduler admits requests and the "
         "engine runs the model in a continuous batch of key value blocks").split()


def prompts(tokenizer, count: int, num_tokens: int) -> list[str]:
    """Distinct text prompts (a number first, so no prefix-cache hits) of about `num_tokens` tokens."""
    out = []
    for i in range(count):
        words = [f"{i}:"]
        while len(tokenizer.encode(" ".join(words))) < num_tokens:
            words.append(WORDS[(i + len(words)) % len(WORDS)])
        out.append(" ".join(words))
    return out


# -- the client process ----------------------------------------------------------------------------

def _client(job: dict) -> dict:
    from benchmarks.sse_client import SSEClient

    path = "/v1/completions"

    async def ttft() -> dict:
        client, samples = SSEClient(job["url"]), []
        for i, prompt in enumerate(job["prompts"]):
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
            got = await client.post_stream(path, body, f"ttft{i}")
            samples.append({"id": f"ttft{i}-0", "sent": got["sent"], "first": got["first"]})
        await client.close()
        return {"samples": samples}

    async def one(i: int, prompt: str) -> tuple[int, int]:
        body = {"prompt": prompt, "max_tokens": job["max_tokens"], "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        client = SSEClient(job["url"])
        got = await client.post_stream(path, body, f"tp{i}")
        await client.close()
        return got["usage"]["completion_tokens"], got["events"] - 1  # the usage event carries no tokens

    async def many() -> dict:
        start, cpu = time.perf_counter(), sum(os.times()[:2])
        done = await asyncio.gather(*(one(i, p) for i, p in enumerate(job["prompts"])))
        wall, cpu = time.perf_counter() - start, sum(os.times()[:2]) - cpu
        return {"tokens": sum(t for t, _ in done), "chunks": sum(c for _, c in done), "wall_s": wall, "cpu_s": cpu}

    return asyncio.run(ttft() if job["kind"] == "ttft" else many())


def run_client(job: dict) -> dict:
    return run_client_process("benchmarks.router_overhead", job)


# -- CPU accounting --------------------------------------------------------------------------------

def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of the live processes among `pids` (from /proc/PID/stat)."""
    total = 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # gone
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def ray_system_pids(session_dir: str) -> list[int]:
    """raylets, GCS, agents: every process whose command line names this cluster's session folder."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if session_dir.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                pids.append(int(entry))
        except OSError:
            continue
    return pids


# -- the benchmark ---------------------------------------------------------------------------------

def measure_ttft(url: str, texts: list[str], marks: dict, prefills: list, warmup: int) -> dict:
    out = run_client({"kind": "ttft", "url": url, "prompts": texts})
    rows = []
    for s in out["samples"][warmup:]:
        m = marks[s["id"]]
        prefill_s = next(v for t, v in prefills if m["enter"] <= t <= m["first_delta"])
        ttft = s["first"] - s["sent"]
        rows.append({"ttft": ttft, "prefill": prefill_s, "added": ttft - prefill_s, "front": m["enter"] - s["sent"],
                     "ray": m["first_delta"] - m["enter"] - prefill_s, "back": s["first"] - m["first_delta"]})
    return {k: {"median": statistics.median(r[k] for r in rows), "p90": statistics.quantiles([r[k] for r in rows], n=10)[-1]}
            for k in rows[0]} | {"n": len(rows)}


async def _ray_level(pool, token_prompts: list[list[int]], params) -> tuple[int, int]:
    from router.orchestrator import Orchestrator

    orchestrator = Orchestrator(pool, "disaggregated")  # its own: the server's lives on uvicorn's loop

    async def one(i: int, prompt: list[int]) -> tuple[int, int]:
        tokens = items = 0
        async for delta in orchestrator.generate(f"ray{time.monotonic_ns()}-{i}", prompt, params):
            tokens += len(delta.token_ids)
            items += 1
        return tokens, items

    try:
        done = await asyncio.gather(*(one(i, p) for i, p in enumerate(token_prompts)))
    finally:
        orchestrator.shutdown()
    return sum(t for t, _ in done), sum(n for _, n in done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50, help="timed sequential requests for TTFT")
    parser.add_argument("--warmup", type=int, default=5, help="untimed requests first")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams for throughput")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the throughput levels")
    args = parser.parse_args()

    import ray

    from benchmarks.local_cluster import router_server, two_node_cluster
    from benchmarks.model_folders import preset_folder
    from benchmarks.report import environment, format_table, write_results
    from router.launcher import ClusterSpec
    from services import Engine
    from services.metrics import METRICS
    from services.sampling_params import SamplingParams
    from services.tokenizer import Tokenizer

    model = str(preset_folder("tiny"))
    tokenizer = Tokenizer.from_folder(model)
    ttft_texts = prompts(tokenizer, args.warmup + args.requests, args.prompt_tokens)
    tp_texts = prompts(tokenizer, args.streams, args.prompt_tokens)
    tp_ids = [tokenizer.encode(t) for t in tp_texts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine = Engine(model, **OPTIONS)
    spec = ClusterSpec(model=model, namespace="pd-bench-router", engine_options=OPTIONS)
    with two_node_cluster(), router_server(spec) as (url, actors, state):
        generate, observe = state.orchestrator.generate, METRICS.request_prefill_time.observe
        marks: dict[str, dict] = {}
        prefills: list[tuple[float, float]] = []  # (when, prefill_seconds) as the router observes them

        async def marked(request_id, prompt, p):
            m = marks[request_id] = {"enter": time.perf_counter()}
            async for delta in generate(request_id, prompt, p):
                m.setdefault("first_delta", time.perf_counter())
                yield delta

        METRICS.request_prefill_time.observe = lambda v: (prefills.append((time.perf_counter(), v)), observe(v))
        state.orchestrator.generate = marked
        ttft = measure_ttft(url, ttft_texts, marks, prefills, args.warmup)
        state.orchestrator.generate, METRICS.request_prefill_time.observe = generate, observe  # unwrapped again

        pids = [ray.get(a.__ray_call__.remote(lambda self: os.getpid())) for a in actors]
        session = ray._private.worker._global_node.get_session_dir_path()
        groups = {"router+driver": [os.getpid()], "prefill worker": [pids[0]], "decode worker": [pids[1]],
                  "ray system": ray_system_pids(session)}
        levels: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            for level in ("engine", "ray", "http"):
                cpu_before = {g: cpu_seconds(p) for g, p in groups.items()}
                start = time.perf_counter()
                client_cpu = 0.0
                if level == "engine":
                    tokens, items = sum(len(o.token_ids) for o in engine.generate(tp_ids, params)), None
                elif level == "ray":
                    tokens, items = asyncio.run(_ray_level(state.pool, tp_ids, params))
                else:
                    res = run_client({"kind": "stream", "url": url, "prompts": tp_texts,
                                      "max_tokens": args.max_tokens})
                    tokens, items, client_cpu = res["tokens"], res["chunks"], res["cpu_s"]
                wall = time.perf_counter() - start if level != "http" else res["wall_s"]  # not the client's start-up
                cpu = {g: cpu_seconds(p) - cpu_before[g] for g, p in groups.items()} | {"client": client_cpu}
                levels.setdefault(level, []).append({"tokens": tokens, "items": items, "wall_s": wall,
                                                     "tokens_per_s": tokens / wall, "cpu_s": cpu})
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in levels.items()}

    print(f"tiny preset, 1 prefill + 1 decode worker (1 torch thread each, unpinned), router in this process, "
          f"client in its own process; {os.cpu_count()} cores shared by all of them")
    what = {"ttft": "client: sent -> first SSE chunk", "prefill": "prefill worker's prefill_seconds",
            "added": "ttft - prefill", "front": "  HTTP in, validate, tokenize", "ray": "  Ray call + return",
            "back": "  first token -> client"}
    rows = [[f"{k:7s} {what[k]}", 1e3 * v["median"], 1e3 * v["p90"]] for k, v in ttft.items() if k != "n"]
    print(f"\n(a) TTFT over HTTP, {ttft['n']} sequential requests, ~{args.prompt_tokens}-token prompts (ms)")
    print(format_table(["part", "median", "p90"], rows))
    added = ttft["added"]["median"]
    print(f"target: added latency <= 5 ms at the median: {'met' if added <= 0.005 else 'MISSED'} ({1e3 * added:.2f} ms)")
    print(f"\n(b) {args.streams} concurrent streams x {args.max_tokens} tokens, best of {args.rounds} rounds")
    groups = list(best["http"]["cpu_s"])
    rows = [[k, v["tokens_per_s"], v["tokens"], v["wall_s"], "-" if v["items"] is None else v["tokens"] / v["items"]]
            + [1e3 * v["cpu_s"].get(g, 0.0) / v["tokens"] for g in groups] for k, v in best.items()]
    print(format_table(["level", "tokens/s", "tokens", "wall s", "tok/item"] + [f"{g} CPU ms/tok" for g in groups],
                       rows))
    tps = best["http"]["tokens_per_s"]
    print(f"target: >= 5,000 tokens/s through one router: {'met' if tps >= 5000 else 'MISSED'} ({tps:,.0f}/s)")
    path = write_results("router_overhead", {"environment": environment(), "args": vars(args),
                                             "engine_options": OPTIONS, "ttft_s": ttft, "throughput": levels})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
