"""Engine phases against the hardware ceilings measured in the same run (docs/BENCHMARKING.md).

On the `1b` preset (random weights), per serving dtype:
- decode, batch 1, ~128-token context: median time of `engine.step()` once the request is decoding
  (prefill step excluded). Bytes the step must read = every weight tensor of `engine.runner.model`
  (lm_head included; the embedding gather is not counted apart, since with tied embeddings the
  table is the lm_head) + the KV of the context. MBU = bytes / step time / read-bandwidth ceiling.
- prefill of one 1,024-token prompt in a single step: FLOPs = 2 x T x (the four projection matrices
  of every layer) + 2 x lm_head (logits of the last token only) + attention 4 x L x T(T+1)/2 x H*Dh
  (causal QK^T and PV); norms, rotary, softmax and SiLU are not counted. Both counts come from
  `services/roofline.py`, the formulas behind the live `pdserve:*_utilization` gauges.
  MFU = FLOPs / step time / matmul ceiling of the dtype.
- decode, batch 32 (32 requests decoding, ~128-token contexts): tokens/s against batch 1.

The machine is shared and noisy, so each timed sample is paired with a ceiling re-measured right
after it (the better of a 2 GB float32 sum and GEMV after each decode step, a 4096^3 F.linear after
each prefill) and the utilization is the median of the per-sample ratios; samples during which other
processes kept more than `--max-foreign-cores` busy are retaken ("quiet" column: quiet/all samples).
Contention from other virtual machines on the host (shared memory bandwidth, sibling hyperthreads)
is not visible to that check; the pairing is what guards against it. The ceilings are also measured
in full at the start and the end of the run; utilizations against them are in the JSON.

    python -m benchmarks.engine_roofline --threads 2 --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks import ceilings as ceilings_mod
from benchmarks.cpu_contention import CpuMeter, wait_for_quiet
from benchmarks.model_folders import describe, preset_folder
from benchmarks.report import environment, format_table, write_results
from services import Engine, SamplingParams
from services.engine_config import QUANTIZATIONS
from services.model_config import ModelConfig

TARGETS = {"decode_mbu": 0.60, "prefill_mfu": 0.50, "batch_speedup": 10.0}


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(4, vocab_size) for _ in range(length)]  # ids 0..3 are special tokens


@dataclass(slots=True)
class Sample:
    seconds: float
    work: float  # bytes the step must read (decode) or FLOPs it must do (prefill)
    ceiling: float  # bytes/s or FLOP/s, re-measured right after the step
    foreign_cores: float  # cores other processes kept busy during the step


def summarize(samples: list[Sample], wanted: int, max_foreign_cores: float) -> dict:
    """Median step time and median per-sample utilization over the quiet samples (all samples, flagged
    `noisy`, when fewer than 3 were quiet)."""
    quiet = [s for s in samples if s.foreign_cores <= max_foreign_cores]
    used = quiet if len(quiet) >= min(3, wanted) else samples
    med = statistics.median
    seconds = med([s.seconds for s in used])
    work = statistics.mean([s.work for s in used])
    return {"step_s_median": seconds, "work_per_step": work, "achieved_rate": work / seconds,
            "ceiling": med([s.ceiling for s in used]), "utilization": med([s.work / s.seconds / s.ceiling for s in used]),
            "num_quiet": len(quiet), "num_samples": len(samples), "noisy": len(quiet) < wanted,
            "samples": [dataclasses.asdict(s) for s in samples]}


def decode_samples(engine: Engine, rng: random.Random, batch: int, args, weight_bytes_total: int,
                   probe: ceilings_mod.ReadProbe) -> dict:
    """Time decode steps of `batch` running requests until `args.steps` ran quiet (at most 4x as many)."""
    max_steps = 4 * args.steps
    params = SamplingParams(max_tokens=args.warmup + max_steps + 2, temperature=0, ignore_eos=True)
    ids = [f"decode-{batch}-{i}-{rng.random()}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, random_prompt(rng, args.context, engine.model_config.vocab_size), params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        engine.step()  # prefill (possibly chunked): not timed
    assert len(sched.running) == batch, "every request must be decoding at once"
    for _ in range(args.warmup):
        engine.step()
    wait_for_quiet(args.max_foreign_cores, timeout_s=args.quiet_timeout)
    samples, contexts = [], []
    while len(samples) < max_steps and sum(s.foreign_cores <= args.max_foreign_cores for s in samples) < args.steps:
        num_kv = sum(s.num_tokens for s in sched.running)  # context incl. the token fed this step
        with CpuMeter() as meter:
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
        work = weight_bytes_total + num_kv * engine.runner.kv_bytes_per_token
        samples.append(Sample(elapsed, work, probe(2), meter.foreign_cores))
        contexts.append(num_kv / batch)
        if meter.foreign_cores > args.max_foreign_cores:  # the state waits with us: retake once quiet
            wait_for_quiet(args.max_foreign_cores, timeout_s=args.quiet_timeout)
    for request_id in ids:
        engine.abort(request_id)
    return {"batch": batch, "mean_context": statistics.mean(contexts), "tokens_per_s": 0.0,
            **summarize(samples, args.steps, args.max_foreign_cores)}


def prefill_samples(engine: Engine, rng: random.Random, args, flops: float, probe: ceilings_mod.MatmulProbe) -> dict:
    """Time the single step that prefills a fresh prompt (after one warm-up), until
    `args.prefill_repeats` ran quiet (at most 3x as many)."""
    samples = []
    for i in range(1 + 3 * args.prefill_repeats):
        request_id = f"prefill-{i}-{rng.random()}"
        prompt = random_prompt(rng, args.prefill_tokens, engine.model_config.vocab_size)  # fresh: no cache hit
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        if i > 0:
            wait_for_quiet(args.max_foreign_cores, timeout_s=args.quiet_timeout)
        with CpuMeter() as meter:
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
        assert not engine.has_unfinished_requests, "the prompt must be prefilled in one step"
        if i > 0:
            samples.append(Sample(elapsed, flops, probe(4), meter.foreign_cores))
            if sum(s.foreign_cores <= args.max_foreign_cores for s in samples) >= args.prefill_repeats:
                break
    return {"tokens": args.prefill_tokens, **summarize(samples, args.prefill_repeats, args.max_foreign_cores)}


def measure_dtype(folder, dtype: str, quantization: str, read_probe: ceilings_mod.ReadProbe, args) -> dict:
    """Each sample is paired with a ceiling measured right after it; utilization is the median of the
    per-sample ratios, so a noisy neighbour slows both sides of a ratio alike."""
    engine = Engine(model=folder, dtype=dtype, quantization=None if quantization == "none" else quantization,
                    kernels=args.kernels, max_num_seqs=max(64, args.batch),
                    max_num_batched_tokens=max(2048, args.prefill_tokens),
                    max_model_len=min(2048 + args.prefill_tokens, ModelConfig.from_folder(folder).max_position_embeddings),
                    num_threads=args.threads, kv_cache_memory_gb=1.0, device=args.device)
    rng = random.Random(args.seed)
    cost = engine.runner.cost  # the same formulas the live efficiency gauges use (services/roofline.py)
    weights = {"bytes": cost.weight_bytes, "layer_matmul_params": cost.layer_matmul_params,
               "lm_head_params": cost.lm_head_params}
    kv_per_token = engine.runner.kv_bytes_per_token

    b1 = decode_samples(engine, rng, 1, args, weights["bytes"], read_probe)
    b1["tokens_per_s"] = 1 / b1["step_s_median"]
    b1 |= {"target": TARGETS["decode_mbu"], "pass": b1["utilization"] >= TARGETS["decode_mbu"]}

    t = args.prefill_tokens
    flops = cost.prefill_flops([t], [t], 1)
    mm_probe = ceilings_mod.MatmulProbe(getattr(torch, dtype), device=args.device)
    mm_probe(10)  # bring the matrix units up to speed before the first pairing
    prefill = prefill_samples(engine, rng, args, flops, mm_probe)
    del mm_probe
    prefill |= {"target": TARGETS["prefill_mfu"], "pass": prefill["utilization"] >= TARGETS["prefill_mfu"]}

    bn = decode_samples(engine, rng, args.batch, args, weights["bytes"], read_probe)
    bn["tokens_per_s"] = args.batch / bn["step_s_median"]
    speedup = bn["tokens_per_s"] / b1["tokens_per_s"]
    bn |= {"speedup_vs_b1": speedup, "target": TARGETS["batch_speedup"], "pass": speedup >= TARGETS["batch_speedup"],
           "noisy": bn["noisy"] or b1["noisy"]}
    del engine
    gc.collect()
    return {"dtype": dtype, "quantization": quantization, "kernels": args.kernels, "weights": weights, "kv_bytes_per_token": kv_per_token,
            "decode_b1": b1, "prefill": prefill, "decode_batch": bn}


def table(r: dict) -> str:
    d1, pf, dn = r["decode_b1"], r["prefill"], r["decode_batch"]

    def verdict(x: dict) -> str:
        return ("PASS" if x["pass"] else "FAIL") + (" (noisy)" if x["noisy"] else "")

    def quiet(x: dict) -> str:
        return f"{x['num_quiet']}/{x['num_samples']}"

    return format_table(
        ["phase", "step time", "work/step", "achieved", "ceiling", "utilization", "quiet", "target", ""],
        [
            [f"decode b=1, ctx~{d1['mean_context']:.0f}", f"{d1['step_s_median'] * 1e3:.1f} ms",
             f"{d1['work_per_step'] / 1e9:.3f} GB", f"{d1['achieved_rate'] / 1e9:.1f} GB/s",
             f"{d1['ceiling'] / 1e9:.1f} GB/s", f"MBU {d1['utilization']:.0%}", quiet(d1),
             f">= {d1['target']:.0%}", verdict(d1)],
            [f"prefill T={pf['tokens']}", f"{pf['step_s_median']:.2f} s", f"{pf['work_per_step'] / 1e12:.3f} TFLOP",
             f"{pf['achieved_rate'] / 1e9:.0f} GFLOP/s", f"{pf['ceiling'] / 1e9:.0f} GFLOP/s",
             f"MFU {pf['utilization']:.0%}", quiet(pf), f">= {pf['target']:.0%}", verdict(pf)],
            [f"decode b={dn['batch']}, ctx~{dn['mean_context']:.0f}", f"{dn['step_s_median'] * 1e3:.1f} ms",
             f"{dn['work_per_step'] / 1e9:.3f} GB", f"{dn['tokens_per_s']:.1f} tok/s",
             f"b=1: {d1['tokens_per_s']:.1f} tok/s", f"{dn['speedup_vs_b1']:.1f}x b=1 (MBU {dn['utilization']:.0%})",
             quiet(dn), f">= {dn['target']:.0f}x", verdict(dn)],
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                        help="serving dtypes to measure (default: both)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=["none", *QUANTIZATIONS],
                        help="weight formats to measure, each with every --dtype (default none)")
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch", "native"],
                        help="how the engine picks its kernels (default auto: measured on this host)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: the engine's and the ceilings' (default cpu)")
    parser.add_argument("--preset", default="1b", help="model preset (default 1b; must exceed the 300 MB L3)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request (default 128)")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per batch size (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (default 2)")
    parser.add_argument("--prefill-tokens", type=int, default=1024, help="prompt length for prefill (default 1024)")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills, after one warm-up (default 3)")
    parser.add_argument("--batch", type=int, default=32, help="large decode batch (default 32)")
    parser.add_argument("--bandwidth-bytes", type=float, default=2e9, help="bandwidth buffer size (default 2e9)")
    parser.add_argument("--max-foreign-cores", type=float, default=0.15,
                        help="a sample is quiet when other processes used at most this many cores during it; "
                             "noisy samples are retaken (default 0.15)")
    parser.add_argument("--quiet-timeout", type=float, default=60,
                        help="seconds to wait for a quiet machine before each phase and after a noisy sample (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = preset_folder(args.preset)
    ceilings = ceilings_mod.measure(int(args.bandwidth_bytes), device=args.device)
    print(f"device={args.device}; threads={args.threads}; ceilings at the start:")
    print(ceilings_mod.table(ceilings), flush=True)
    shape = describe(ModelConfig.from_folder(folder))
    read_probe = ceilings_mod.ReadProbe(int(args.bandwidth_bytes), args.device)
    results = []
    for dtype, quantization in [(d, q) for d in args.dtype for q in args.quantization]:
        r = measure_dtype(folder, dtype, quantization, read_probe, args)
        results.append(r)
        w = r["weights"]
        print(f"\n{args.preset} ({shape}); device={args.device}; dtype={dtype}; quantization={quantization}; "
              f"kernels={args.kernels}; threads={args.threads}; weights read per step "
              f"{w['bytes'] / 1e9:.3f} GB ({(w['layer_matmul_params'] + w['lm_head_params']) / 1e9:.3f}B matmul params); "
              f"KV {r['kv_bytes_per_token'] / 1024:.0f} KiB/token")
        print(table(r), flush=True)
    del read_probe
    ceilings_end = ceilings_mod.measure(int(args.bandwidth_bytes), device=args.device)
    print("\nceilings at the end:")
    print(ceilings_mod.table(ceilings_end))
    for r in results:  # against the best full measurement of the run, for reference
        best_read = max(ceilings["read_gbps"], ceilings_end["read_gbps"]) * 1e9
        best_mm = max(ceilings["matmul_flops"][r["dtype"]], ceilings_end["matmul_flops"][r["dtype"]])
        for key in ("decode_b1", "decode_batch"):
            r[key]["mbu_vs_best_ceiling"] = r[key]["achieved_rate"] / best_read
        r["prefill"]["mfu_vs_best_ceiling"] = r["prefill"]["achieved_rate"] / best_mm
    payload = {"environment": environment(), "preset": args.preset, "model_shape": shape, "args": vars(args),
               "ceilings_start": ceilings, "ceilings_end": ceilings_end, "results": results}
    print(f"wrote {write_results('engine_roofline', payload)}")


if __name__ == "__main__":
    main()
