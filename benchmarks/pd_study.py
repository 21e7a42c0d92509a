"""Colocated vs disaggregated serving on the same pinned cores, under the same Poisson workload of
long prompts: the measurement behind `pdserve study`.

Each topology in turn gets the same cores, one worker process per core group (pinned, one torch
thread per core), behind a router in this process; the load is `pdserve bench` itself, in its own
process, with the same seed (the same prompts and arrival times) every time:
  colocated: every worker prefills and decodes (a prompt is one step: `max_num_batched_tokens` 2048);
  colocated, chunked prefill: the same with prompts fed in chunks of `chunk_size` tokens, the
    standard remedy (vLLM's chunked prefill), which bounds a stall by the chunk's time;
  disaggregated P:D: P prefill and D decode workers, every P + D split of the workers;
  disaggregated 1:1, cost model: the router prefills a prompt on its decode worker when the cost
    model says the hand-off costs more (`--local-prefill-tokens auto`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class Topology:
    name: str
    mode: str  # "colocated" | "disaggregated"
    num_prefill: int = 0
    num_decode: int = 0
    max_num_batched_tokens: int = 2048
    local_prefill_tokens: int | None = 0  # None: the cost model decides per request

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def is_split(self) -> bool:
        return self.mode == "disaggregated" and self.local_prefill_tokens == 0


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_len: int
    num_prompts: int
    request_rates: tuple[float, ...]  # each topology runs the workload at each rate, in turn
    tpot_slo_ms: float
    ttft_slo_ms: float | None
    seed: int


KINDS = ("colocated", "chunked", "split", "auto")
OBJECTIVE_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0)  # goodput is also reported at these multiples of the TPOT objective


def topologies(num_workers: int, chunk_size: int, kinds: tuple[str, ...] = KINDS) -> list[Topology]:
    """The topologies of `kinds` for `num_workers` workers (one per core group)."""
    if num_workers < 2:
        raise ValueError(f"the study needs at least 2 workers (cores), got {num_workers}")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown topology kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    found = []
    if "colocated" in kinds:
        found.append(Topology("colocated", "colocated", num_decode=num_workers))
    if "chunked" in kinds:
        found.append(Topology(f"colocated, chunked prefill ({chunk_size})", "colocated", num_decode=num_workers,
                              max_num_batched_tokens=chunk_size))
    if "split" in kinds:
        found += [Topology(f"disaggregated {p}:{num_workers - p}", "disaggregated", p, num_workers - p)
                  for p in range(1, num_workers)]
    if "auto" in kinds:
        half = num_workers // 2
        found.append(Topology(f"disaggregated {half}:{num_workers - half}, cost model", "disaggregated", half,
                              num_workers - half, local_prefill_tokens=None))
    return found


def measure(model: str, topology: Topology, workload: Workload, cores: list[int], engine_options: dict,
            index: int, out_dir: Path) -> list[dict]:
    """Start `topology`'s workers on `cores`, serve a router, run `pdserve bench` at each rate; the
    result dict of each run."""
    from benchmarks.local_cluster import serve_router
    from router.launcher import ClusterSpec, start_workers, stop_workers

    threads = max(1, len(cores) // topology.num_workers)
    options = {**engine_options, "num_threads": threads, "max_num_batched_tokens": topology.max_num_batched_tokens}
    options["max_num_seqs"] = min(options.get("max_num_seqs", 64), topology.max_num_batched_tokens)
    spec = ClusterSpec(model=model, mode=topology.mode, num_prefill=topology.num_prefill or 1,
                       num_decode=topology.num_decode, num_colocated=topology.num_decode,
                       namespace=f"pd-study-{os.getpid()}-{index}", engine_options=options)
    actors = start_workers(spec, local=True)
    results = []
    try:
        with serve_router(spec, "study-model", local_prefill_tokens=topology.local_prefill_tokens) as (url, state):
            _warm_up(url, state.pool, topology)
            for rate in workload.request_rates:
                load_before = os.getloadavg()
                result = run_bench(url, workload, rate, out_dir / f"bench-{index}-rate{rate:g}.json")
                result["load_average_before"], result["load_average_after"] = load_before, os.getloadavg()
                results.append(result)
    finally:
        stop_workers(actors)
    objectives = [f * workload.tpot_slo_ms for f in OBJECTIVE_FACTORS]
    for result in results:
        result["topology"] = topology.name
        result["threads_per_worker"] = threads
        result["goodput_by_tpot_objective"] = goodput_by_tpot(result, objectives)
    return results


def goodput_by_tpot(result: dict, objectives_ms: list[float]) -> dict[str, float]:
    """Requests per second whose TPOT met each objective (TPOT alone; a one-token request's TPOT is 0,
    as vLLM counts it): how the goodput comparison depends on where the objective is set."""
    tpots = [(result["e2els"][i] - result["ttfts"][i]) / (n - 1) if n > 1 else 0.0
             for i, n in enumerate(result["output_lens"]) if not result["errors"][i]]
    return {f"{ms:g}": sum(1e3 * t <= ms for t in tpots) / result["duration"] for ms in objectives_ms}


def run_bench(url: str, workload: Workload, rate: float, result_path: Path) -> dict:
    """`pdserve bench` in its own process (the load client never shares this process's GIL)."""
    goodput = [f"tpot:{workload.tpot_slo_ms:g}"] + ([f"ttft:{workload.ttft_slo_ms:g}"] if workload.ttft_slo_ms else [])
    command = [sys.executable, "-m", "router.cli", "bench", "--base-url", url, "--dataset-name", "random",
               "--random-input-len", str(workload.prompt_len), "--random-output-len", str(workload.output_len),
               "--num-prompts", str(workload.num_prompts), "--request-rate", f"{rate:g}",
               "--seed", str(workload.seed), "--goodput", *goodput, "--result-json", str(result_path),
               "--ignore-eos", "--disable-tqdm", "--request-timeout", "300"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pdserve bench failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(result_path.read_text())


def _warm_up(url: str, pool, topology: Topology, timeout: float = 60.0) -> None:
    """A few short requests through every worker (the first forward of a process is slow), and for the
    cost model, until the router has measured the rates it needs."""
    for i in range(2 * topology.num_workers):
        body = {"prompt": [5 + i] * 48, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        response = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        response.raise_for_status()
    if topology.local_prefill_tokens is not None:
        return
    deadline = time.monotonic() + timeout
    while not (pool.kv_bytes_per_second and pool.best("prefill").prefill_tokens_per_second):
        if time.monotonic() > deadline:
            raise RuntimeError("the router measured no prefill rate or KV transfer after the warm-up")
        time.sleep(0.2)


def summarize(results: list[dict]) -> dict:
    """The headline ratios of runs at one rate: colocated over the best split for p99 ITL, the best
    split's goodput over colocated's, and which split was best (most goodput; then lowest p99 ITL)."""
    by_name = {r["topology"]: r for r in results}
    splits = [r for r in results if r["topology"].startswith("disaggregated") and "cost model" not in r["topology"]]
    summary: dict = {}
    if splits:
        best = max(splits, key=lambda r: (r["request_goodput"], -r["p99_itl_ms"]))
        one_to_one = next((r for r in splits if r["topology"].endswith(" 1:1")), splits[0])
        summary |= {"best_split": best["topology"], "one_to_one": one_to_one["topology"]}
    colocated = by_name.get("colocated")
    if colocated and splits:
        summary["p99_itl_colocated_over_disaggregated"] = _ratio(colocated["p99_itl_ms"], best["p99_itl_ms"])
        summary["goodput_disaggregated_over_colocated"] = _ratio(best["request_goodput"], colocated["request_goodput"])
        summary["p99_tpot_colocated_over_disaggregated"] = _ratio(colocated["p99_tpot_ms"], best["p99_tpot_ms"])
    return summary


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None
