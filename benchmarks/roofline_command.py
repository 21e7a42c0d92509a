"""`pdserve roofline --model M --out DIR`: the three questions behind disaggregated serving, measured on
this host (benchmarks/roofline_probe.py), written to roofline.json with one PNG per question:

1. prefill_vs_length.png: how prefill time grows with prompt length, and the fitted linear and
   quadratic terms (where attention starts to matter);
2. batching.png: decode step time against batch size next to prefill step time against batch size,
   and both on the roofline (FLOP/s against FLOPs per byte) under the bandwidth and FLOP ceilings,
   with the ridge point;
3. disaggregation.png: what a running stream waits when a prompt arrives: colocated (the whole
   prefill step), colocated with chunked prefill (one chunk per step), disaggregated (no prefill on
   its worker), from the measured step times. `pdserve study` measures the same end to end.

Importing this module imports no torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from router import cli_values as flags


def add_command(subparsers) -> None:
    roof = subparsers.add_parser("roofline", help="prefill vs length, decode vs batch, against the host's ceilings")
    roof.add_argument("--model", default="small", help="a model folder or preset (default small)")
    roof.add_argument("--out", required=True, help="folder for roofline.json and the PNGs")
    roof.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    roof.add_argument("--threads", type=flags.positive_int, default=None, help="torch threads (default: torch's)")
    roof.add_argument("--lengths", type=flags.positive_int, nargs="+", default=[128, 256, 512, 1024, 2048],
                      help="prompt lengths for question 1")
    roof.add_argument("--batches", type=flags.positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                      help="batch sizes for question 2")
    roof.add_argument("--context", type=flags.positive_int, default=256, help="decode context per sequence")
    roof.add_argument("--prefill-len", type=flags.positive_int, default=128,
                      help="prompt length of the prefill batches of question 2")
    roof.add_argument("--chunk-size", type=flags.positive_int, default=256, help="the chunked prefill of question 3")
    roof.add_argument("--decode-batch", type=flags.positive_int, default=8,
                      help="the running decode batch of question 3 (one of --batches)")
    roof.add_argument("--repeats", type=flags.positive_int, default=2, help="timed prefill steps per point (best)")
    roof.add_argument("--steps", type=flags.positive_int, default=5, help="timed decode steps per point (median)")
    roof.add_argument("--kv-cache-memory-gb", type=flags.positive_float, default=1.0)
    roof.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from benchmarks.roofline_plots import write_plots
    from benchmarks.roofline_report import measure

    if args.decode_batch not in args.batches:
        raise ValueError(f"--decode-batch {args.decode_batch} must be one of --batches {args.batches}")
    if args.chunk_size > max(args.lengths):
        raise ValueError(f"--chunk-size {args.chunk_size} is longer than every --lengths value")
    from benchmarks.plots import pyplot

    pyplot()  # a missing matplotlib fails now, not after the run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = measure(args)
    (out / "roofline.json").write_text(json.dumps(report, indent=1) + "\n")
    _print(report)
    for path in [out / "roofline.json", *write_plots(report, out)]:
        print(f"wrote {path}")


def _print(report: dict) -> None:
    fit, peaks = report["prefill_vs_length"]["fit"], report["ceilings"]
    print(f"{report['model']} ({report['dtype']}, {report['environment']['num_threads']} threads) on "
          f"{report['environment']['cpu']}: matmul {peaks['flops_per_second'] / 1e9:.0f} GFLOP/s, read "
          f"{peaks['bytes_per_second'] / 1e9:.1f} GB/s, ridge {peaks['ridge_flops_per_byte']:.1f} FLOP/byte")
    crossover = fit["attention_crossover_tokens"]
    print(f"1. prefill t(L) = {fit['intercept_s'] * 1e3:.1f} ms + {fit['linear_s_per_token'] * 1e6:.1f} us*L + "
          f"{fit['quadratic_s_per_token2'] * 1e9:.3f} ns*L^2: attention matters from L ~ "
          f"{'n/a' if crossover is None else f'{crossover:,.0f}'} tokens (cost formula: "
          f"{report['prefill_vs_length']['formula_crossover_tokens']:,.0f})")
    batching = report["batching"]
    d1, dn = batching["decode"][0], batching["decode"][-1]
    p1, pn = batching["prefill"][0], batching["prefill"][-1]
    print(f"2. decode step x{dn['seconds'] / d1['seconds']:.2f} from batch {d1['size']} to {dn['size']}; prefill "
          f"step x{pn['seconds'] / p1['seconds']:.2f} over the same batches; decode becomes compute-bound near "
          f"batch {batching['decode_compute_bound_batch']:,.0f}")
    points = [p for key in ("prefill_vs_length", "batching") for group in ("points", "decode", "prefill")
              for p in report[key].get(group, [])]
    noisy = sum(p["foreign_cores"] > 0.25 for p in points)
    if noisy:
        print(f"note: {noisy} of {len(points)} points ran while other processes kept more than a quarter of a core "
              f"busy (foreign_cores in roofline.json): their times are the host's as much as the model's")
    for row in report["disaggregation"]["rows"]:
        print(f"3. a {row['prompt_len']}-token prompt arriving: a running stream waits {row['colocated_s'] * 1e3:.0f} ms "
              f"colocated, {row['chunked_s'] * 1e3:.0f} ms per step for {row['chunked_steps']} steps chunked, "
              f"{row['disaggregated_s'] * 1e3:.0f} ms disaggregated ({row['colocated_over_disaggregated']:.1f}x)")
