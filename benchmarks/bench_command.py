"""`pdserve bench`: a serving benchmark for any OpenAI-compatible server, with the flags and result
keys of vLLM's `vllm bench serve` (docs/benchmarks.md). Importing this module imports no torch."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from pathlib import Path

from router import cli_values as flags


def _rate(value: str) -> float:
    try:
        rate = float(value)  # "inf" included
    except ValueError:
        raise argparse.ArgumentTypeError(f"a request rate is a number of requests/s or inf, got {value!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be positive (or inf), got {value!r}")
    return rate


def _percentiles(value: str) -> tuple[float, ...]:
    try:
        found = tuple(float(p) for p in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"percentiles are comma-separated numbers, got {value!r}") from None
    if not all(0 < p <= 100 for p in found):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {value!r}")
    return found


def add_command(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (vLLM bench serve's flags)")
    bench.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    bench.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    bench.add_argument("--model", default=None, help="default: the first model of /v1/models")
    bench.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    bench.add_argument("--dataset-name", default="random", choices=("random", "sharegpt", "jsonl"))
    bench.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file; jsonl: {\"prompt\": ...} lines")
    bench.add_argument("--random-input-len", type=flags.positive_int, default=1024)
    bench.add_argument("--random-output-len", type=flags.positive_int, default=128)
    bench.add_argument("--random-range-ratio", type=flags.non_negative_float, default=0.0,
                       help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    bench.add_argument("--random-vocab-size", type=flags.positive_int, default=256,
                       help="random prompts draw token ids from [4, N) (default %(default)s)")
    bench.add_argument("--output-len", type=flags.positive_int, default=None,
                       help="sharegpt/jsonl: output tokens per request (default: the dataset's)")
    bench.add_argument("--num-prompts", type=flags.positive_int, default=100)
    bench.add_argument("--request-rate", type=_rate, nargs="+", default=[math.inf],
                       help="requests/s (Poisson arrivals; inf: all at once); several values: a sweep")
    bench.add_argument("--burstiness", type=flags.positive_float, default=1.0,
                       help="gamma shape of the arrival gaps (1: Poisson; lower: burstier)")
    bench.add_argument("--max-concurrency", type=flags.positive_int, default=None)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                       help="objectives for goodput, e.g. ttft:500 tpot:50 (NAME: ttft, tpot, e2el)")
    bench.add_argument("--metric-percentiles", type=_percentiles, default=(50.0, 90.0, 99.0),
                       help="comma-separated percentiles reported for TTFT, TPOT, ITL, E2E (default 50,90,99)")
    bench.add_argument("--ignore-eos", action="store_true",
                       help="every request makes exactly its output length (vLLM's and pdserve's ignore_eos)")
    bench.add_argument("--request-timeout", type=flags.positive_float, default=600.0,
                       help="seconds without a byte after which a request counts as failed")
    bench.add_argument("--result-json", default=None, help="write the result here (a sweep: one file per rate)")
    bench.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    bench.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from benchmarks import serve_bench
    from benchmarks.serve_metrics import parse_goodput

    goodput = parse_goodput(args.goodput) if args.goodput else None
    if args.plot:
        from benchmarks.plots import pyplot

        pyplot()  # fail before the run, not after it
    base_url = args.base_url.rstrip("/")
    requests = _requests(args, base_url)
    results = []
    for rate in args.request_rate:
        config = serve_bench.BenchConfig(
            base_url=base_url, endpoint=args.endpoint, model=args.model or "", api_key=args.api_key,
            request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
            goodput=goodput, percentiles=args.metric_percentiles, ignore_eos=args.ignore_eos,
            timeout_s=args.request_timeout, progress=not args.disable_tqdm)
        result = asyncio.run(serve_bench.run(requests, config))
        print(serve_bench.summary(result), flush=True)
        results.append(result)
    if args.result_json:
        for path, result in zip(_result_paths(args.result_json, args.request_rate), results):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {path}")
    if args.plot:
        _plots(results, Path(args.plot))


def _result_paths(name: str, rates: list[float]) -> list[Path]:
    path = Path(name)
    if len(rates) == 1:
        return [path]
    return [path.with_name(f"{path.stem}-rate{rate:g}{path.suffix or '.json'}") for rate in rates]


def _plots(results: list[dict], folder: Path) -> None:
    from benchmarks import plots

    title = f"{results[0]['model_id']} at {results[0]['base_url']}{results[0]['endpoint']}"
    written = [plots.latency_cdfs({f"{r['request_rate']} req/s": r for r in results}, folder / "latency_cdf.png", title)]
    if len(results) > 1:
        written.append(plots.rate_sweep(results, folder / "rate_sweep.png", title))
    for path in written:
        print(f"wrote {path}")


def _requests(args: argparse.Namespace, base_url: str) -> list:
    """The dataset's requests; token counts and detokenized text come from the server."""
    from benchmarks import serve_dataset as data
    from benchmarks.server_tokens import ServerTokens

    rng = random.Random(args.seed)
    tokens = ServerTokens(base_url, args.api_key)
    if args.dataset_name == "random":
        requests = data.random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                        args.random_range_ratio, args.random_vocab_size, rng)
        if args.endpoint.endswith("chat/completions"):  # chat takes text: the server spells the ids
            requests = [data.SampleRequest(tokens.text(r.prompt), r.prompt_len, r.expected_output_len)
                        for r in requests]
        return requests
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "sharegpt":
        return data.sharegpt_requests(args.dataset_path, args.num_prompts, args.output_len, tokens.count, rng)
    return data.jsonl_requests(args.dataset_path, args.num_prompts, args.output_len, tokens.count)
