"""`pdserve study`: colocated vs disaggregated serving on the same pinned cores under one Poisson
workload of long prompts (benchmarks/pd_study.py); a table, study.json and a study PNG per rate
(and one by rate). Importing this module imports no torch."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from router import cli_values as flags

PER_REQUEST = ("ttfts", "itls", "e2els", "input_lens", "output_lens", "errors")  # kept in each bench-*.json


def add_command(subparsers) -> None:
    study = subparsers.add_parser("study", help="colocated vs disaggregated on the same cores, one Poisson workload")
    study.add_argument("--model", default="small", help="a model folder or preset (default small)")
    study.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    study.add_argument("--prompt-len", type=flags.positive_int, default=768)
    study.add_argument("--output-len", type=flags.positive_int, default=96)
    study.add_argument("--num-prompts", type=flags.positive_int, default=24)
    study.add_argument("--request-rate", type=flags.positive_float, nargs="+", default=[0.8, 1.2],
                       help="requests/s, Poisson; each topology runs at each (default 0.8 1.2: on 2 cores of "
                            "a Zen 4, colocated serving of `small` starts to miss TPOT at 0.8 and is loaded at 1.2)")
    study.add_argument("--tpot-slo", type=flags.positive_float, default=100.0,
                       help="the TPOT objective of goodput, ms (default %(default)s, DistServe's chatbot "
                            "objective); goodput is also reported at 0.5-2x it")
    study.add_argument("--ttft-slo", type=flags.positive_float, default=None, help="also a TTFT objective, ms")
    study.add_argument("--chunk-size", type=flags.positive_int, default=256,
                       help="the chunked-prefill colocated topology's max_num_batched_tokens (default %(default)s)")
    study.add_argument("--topologies", nargs="+", default=["colocated", "chunked", "split", "auto"],
                       choices=("colocated", "chunked", "split", "auto"),
                       help="which to measure (split: every P:D split of the workers)")
    study.add_argument("--cores", type=flags.positive_int, default=None,
                       help="cores to use, one worker each (default: every core this process may run on)")
    study.add_argument("--seed", type=int, default=0)
    study.add_argument("--out", default="study", help="folder for study.json and study.png (default ./study)")
    study.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    import ray

    from benchmarks import pd_study, plots
    from benchmarks.report import environment, format_table
    from router.cli import resolve_model
    from router.launcher import ClusterSpec
    from router.ray_instance import init_local_ray

    plots.pyplot()  # a missing matplotlib fails now, not after the run
    available = sorted(os.sched_getaffinity(0))
    cores = available[: args.cores or len(available)]
    if args.cores and args.cores > len(available):
        raise ValueError(f"--cores {args.cores}: this process may run on {len(available)} cores only")
    found = pd_study.topologies(len(cores), args.chunk_size, tuple(args.topologies))
    workload = pd_study.Workload(args.prompt_len, args.output_len, args.num_prompts, tuple(args.request_rate),
                                 args.tpot_slo, args.ttft_slo, args.seed)
    model = resolve_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # No prefix caching: the workers serve every rate in turn, and the same seed sends the same prompts.
    engine_options = {"dtype": args.dtype, "max_num_seqs": 64, "kv_cache_memory_gb": 1.0, "enable_prefix_caching": False,
                      "max_model_len": max(2048, args.prompt_len + args.output_len + 64)}
    results = []
    os.sched_setaffinity(0, cores)  # the workers Ray starts from here are then pinned within these cores
    init_local_ray(ClusterSpec(model=model, mode="colocated", num_colocated=len(cores)), num_cpus=len(cores))
    try:
        for index, topology in enumerate(found):
            print(f"[{index + 1}/{len(found)}] {topology.name} ...", end=" ", flush=True)
            start = time.perf_counter()
            results.extend(pd_study.measure(model, topology, workload, cores, engine_options, index, out))
            print(f"{time.perf_counter() - start:.0f} s", flush=True)
    finally:
        ray.shutdown()
    report = {"environment": environment() | {"cores": cores, "load_average_end": os.getloadavg()},
              "model": model, "workload": vars(workload), "summary": {}, "results": []}
    pictures = []
    for rate in workload.request_rates:
        at_rate = [r for r in results if r["request_rate"] == rate]
        report["summary"][f"{rate:g}"] = summary = pd_study.summarize(at_rate)
        print(f"\n{rate:g} requests/s:\n{_table(at_rate, workload, format_table)}")
        objectives = list(at_rate[0]["goodput_by_tpot_objective"])
        print("goodput (req/s) at other TPOT objectives:\n" + format_table(
            ["topology", *(f"<= {ms} ms" for ms in objectives)],
            [[r["topology"], *r["goodput_by_tpot_objective"].values()] for r in at_rate]))
        for key, value in summary.items():
            print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
        pictures.append(plots.study_figure({r["topology"]: r for r in at_rate}, workload.tpot_slo_ms,
                                           out / f"study-rate{rate:g}.png", _title(model, args, f"{rate:g} req/s", cores)))
    if len(workload.request_rates) > 1:
        pictures.append(plots.study_rates(results, out / "study-rates.png", _title(model, args, "by rate", cores)))
    report["results"] = [{k: v for k, v in r.items() if k not in PER_REQUEST} for r in results]
    (out / "study.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'study.json'}, " + ", ".join(str(p) for p in pictures))


def _title(model: str, args: argparse.Namespace, rates: str, cores: list[int]) -> str:
    return (f"{Path(model).name}: {args.prompt_len}-token prompts, {args.output_len} out, {rates} Poisson, "
            f"{len(cores)} cores")


def _table(results: list[dict], workload, format_table) -> str:
    header = ["topology", "TTFT p50 ms", "p99", "ITL p50 ms", "p99", "TPOT p99 ms", "goodput req/s",
              f"met TPOT<={workload.tpot_slo_ms:g}ms", "failed", "load avg"]
    rows = [[r["topology"], r["median_ttft_ms"], r["p99_ttft_ms"], r["median_itl_ms"], r["p99_itl_ms"],
             r["p99_tpot_ms"], r["request_goodput"], f"{round(r['request_goodput'] * r['duration'])}/{r['completed']}",
             r["failed"], f"{r['load_average_before'][0]:.1f}"] for r in results]
    return format_table(header, rows)
