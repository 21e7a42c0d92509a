"""The figures of a serving benchmark, under vLLM's `bench serve` result keys and definitions, so
results compare across systems.

Per successful request: TTFT; TPOT = (latency - TTFT) / (output tokens - 1), for requests with more
than one token (goodput counts a one-token request's TPOT as 0); every ITL; E2E latency. Over them:
mean, median, std and the chosen percentiles (numpy's linear interpolation), in milliseconds, as
`mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ... Goodput (DistServe's definition):
requests per second that met every objective given (`ttft`, `tpot`, `e2el`, in ms).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from benchmarks.serve_request import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def percentile_key(metric: str, p: float) -> str:
    """vLLM's key for a percentile: `p99_itl_ms`, `p99.9_ttft_ms`."""
    return f"p{int(p) if float(p).is_integer() else p}_{metric}_ms"


def output_len(out: RequestOutput) -> int:
    """The usage's token count, else one per event (a server that sends no usage)."""
    return out.output_tokens or len(out.itl) + 1


def calculate_metrics(outputs: Sequence[RequestOutput], duration_s: float, goodput: dict[str, float] | None = None,
                      percentiles: Sequence[float] = (50, 90, 99)) -> dict:
    if duration_s <= 0:
        raise ValueError(f"the duration must be positive, got {duration_s}")
    ok = [o for o in outputs if o.success]
    output_lens = [output_len(o) for o in ok]
    samples: dict[str, list[float]] = {"ttft": [o.ttft for o in ok], "itl": [g for o in ok for g in o.itl],
                                       "e2el": [o.latency for o in ok]}
    all_tpots = [(o.latency - o.ttft) / (n - 1) if n > 1 else 0.0 for o, n in zip(ok, output_lens)]
    samples["tpot"] = [t for t, n in zip(all_tpots, output_lens) if n > 1]
    per_request = {"ttft": samples["ttft"], "tpot": all_tpots, "e2el": samples["e2el"]}
    good = 0
    if goodput:
        good = sum(all(per_request[m][i] <= goodput[m] / 1e3 for m in goodput) for i in range(len(ok)))
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(output_lens)
    result = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for metric in METRICS:
        values = np.asarray(samples[metric] or [0.0]) * 1e3  # vLLM reports 0 where there is no sample
        result[f"mean_{metric}_ms"] = float(values.mean())
        result[f"median_{metric}_ms"] = float(np.median(values))
        result[f"std_{metric}_ms"] = float(values.std())
        for p in percentiles:
            result[percentile_key(metric, p)] = float(np.percentile(values, p))
    return result


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds), as vLLM's `--goodput`."""
    objectives = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the objective must be positive")
        objectives[name] = ms
    return objectives
