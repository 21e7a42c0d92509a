"""Tensor parallelism on this host: prefill and decode of `small` at TP = 2 against TP = 1, the share
of a step spent in the group's collectives, and the cost of a KV hand-off between groups of
different sizes against one between groups of the same size.

Method. The offline engine (`Engine(model, tensor_parallel_size=N)`: this process is rank 0, the
other rank a spawned process, gloo over loopback), float32, one torch thread per rank, each rank
pinned to its own core (TP = 1 on core 0; TP = 2 on cores 0 and 1); a TP = 1 engine with two threads
on both cores is the same-cores reference. The three engines live side by side (rank 0 of each in
this process, which takes each engine's cores and threads before running it) and their trials
interleave, so the host's load falls on all three alike. Prefill: one prompt of `--prompt-tokens`,
prefix caching off, median of `--trials`. Decode: `--batch` sequences, the median step of
`--decode-steps`, median over the trials. The
collectives' share: rank 0's time inside all-reduce / gather / broadcast (timed around each call,
so it includes waiting for the other rank) over its step time. Hand-off: the export on the prefill
side (TP = 2: the other rank's heads sent to rank 0) plus the import on the decode side (TP = 2: rank
0 sends the other rank its heads, re-sliced from the payload) for 1->1, 2->2, 2->1 and 1->2, medians
of `--trials`; the checksum pass (`KVPayload.verify`) is timed apart. Only ratios measured in one
run mean anything on a shared host; the load average is printed with them.

    python -m benchmarks.tensor_parallel [--prompt-tokens 512] [--batch 4] [--trials 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.report import environment, format_table, write_results
from benchmarks.tensor_parallel_probe import Probe, all_reduce_alone
from router.cli import resolve_model


def run(args: argparse.Namespace) -> dict:
    model = resolve_model(args.model)
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    out: dict = {"model": args.model, "prompt_tokens": args.prompt_tokens, "batch": args.batch}
    probes = {"tp1": Probe(model, 1, 1, cores[:1]), "tp2": Probe(model, 2, 1, cores),
              "tp1_two_threads": Probe(model, 1, 2, cores)}  # the same two cores, one engine, two threads
    for probe in probes.values():  # warm-up: first-call costs out of the timings
        probe.prefill(args.prompt_tokens)
        probe.decode(args.batch, 2)
    samples: dict[str, list] = {name: [] for name in probes}
    for _ in range(args.trials):  # interleaved, so the host's load hits every engine alike
        for name, probe in probes.items():
            samples[name].append((probe.prefill(args.prompt_tokens), probe.decode(args.batch, args.decode_steps)))
    for name, runs in samples.items():
        out[name] = {"prefill_s": statistics.median(p[0] for p, _ in runs),
                     "prefill_collective_share": statistics.median(p[1] for p, _ in runs),
                     "decode_step_s": statistics.median(d[0] for _, d in runs),
                     "decode_collective_share": statistics.median(d[1] for _, d in runs),
                     "decode_plan_broadcast_s": statistics.median(d[2] for _, d in runs)}
    single, wide = probes["tp1"], probes["tp2"]
    export1, payload1, prompt = single.export(args.kv_tokens, args.trials)
    export2, payload2, _ = wide.export(args.kv_tokens, args.trials)
    handoff = {}
    for name, probe, payload, export in (("1->1", single, payload1, export1), ("2->1", single, payload2, export2),
                                         ("1->2", wide, payload1, export1), ("2->2", wide, payload2, export2)):
        imported, check = probe.import_kv(payload, prompt, args.trials)
        handoff[name] = {"export_s": export, "import_s": imported, "verify_s": check}
    out["handoff"] = handoff
    out["kv_bytes"] = payload1.num_bytes
    wide.close()
    config = single.engine.model_config
    per_step = 2 * config.num_layers + 1  # o and down in every layer, and the embedding
    shapes = [(args.prompt_tokens, config.hidden_size), (args.batch, config.hidden_size)]
    prefill_ar, decode_ar = all_reduce_alone(cores, shapes)
    out["all_reduce_alone"] = {"per_step": per_step, "prefill_s": prefill_ar, "decode_s": decode_ar,
                               "prefill_share": per_step * prefill_ar / out["tp2"]["prefill_s"],
                               "decode_share": per_step * decode_ar / out["tp2"]["decode_step_s"]}
    return out


def tables(out: dict) -> str:
    ms = 1e3
    t1, t2, tt = out["tp1"], out["tp2"], out["tp1_two_threads"]
    rows = [["TP=1, 1 core", t1["prefill_s"] * ms, 1.0, t1["decode_step_s"] * ms, 1.0, "-", "-"],
            ["TP=2, 1 core/rank", t2["prefill_s"] * ms, t1["prefill_s"] / t2["prefill_s"], t2["decode_step_s"] * ms,
             t1["decode_step_s"] / t2["decode_step_s"], f"{t2['prefill_collective_share']:.1%}",
             f"{t2['decode_collective_share']:.1%}"],
            ["TP=1, 2 threads", tt["prefill_s"] * ms, t1["prefill_s"] / tt["prefill_s"], tt["decode_step_s"] * ms,
             t1["decode_step_s"] / tt["decode_step_s"], "-", "-"]]
    first = format_table(["engine", "prefill ms", "speed-up", "decode step ms", "speed-up",
                          "collectives/prefill", "collectives/decode"], rows)
    same = {"1->1": "1->1", "2->1": "1->1", "1->2": "2->2", "2->2": "2->2"}
    hrows = []
    for name, h in out["handoff"].items():
        total = h["export_s"] + h["import_s"]
        ref = out["handoff"][same[name]]
        hrows.append([name, h["export_s"] * ms, h["import_s"] * ms, h["verify_s"] * ms, total * ms,
                      total / (ref["export_s"] + ref["import_s"])])
    second = format_table(["prefill->decode TP", "export ms", "import ms", "verify ms", "export+import ms",
                           "vs same-TP into that decode size"], hrows)
    ar = out["all_reduce_alone"]
    third = (f"an all-reduce alone (two ranks, own cores): {ar['prefill_s'] * 1e6:.0f} us for "
             f"[{out['prompt_tokens']}, D], {ar['decode_s'] * 1e6:.0f} us for [{out['batch']}, D]; x {ar['per_step']} "
             f"per step = {ar['prefill_share']:.1%} of the TP=2 prefill, {ar['decode_share']:.1%} of its decode step; "
             f"the step plan's broadcast (pickled, in-step): {out['tp2']['decode_plan_broadcast_s'] * 1e6:.0f} us "
             f"per decode step")
    return first + "\n\n" + second + "\n\n" + third


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="a preset or folder (default small)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="decode batch")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=1024, help="prompt tokens of the handed-off KV")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    for name in ("prompt_tokens", "batch", "decode_steps", "kv_tokens", "trials"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    load = os.getloadavg()
    out = run(args)
    env = environment()
    print(f"{args.model}, float32, {env['cpu']}, load average {load[0]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end; medians of {args.trials}; KV {out['kv_bytes'] / 2**20:.1f} MiB")
    print(tables(out))
    path = write_results("tensor_parallel", {"environment": env, "load_average": [load, os.getloadavg()],
                                             "args": vars(args), **out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
