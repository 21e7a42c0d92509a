"""A decode step with its layers in one native call (services/kernels/decode_chain.py) against the model's Python
loop over the same kernels, in one engine, the two alternated step by step (this host's noise moves a whole step by
more than the difference between processes): milliseconds a step, the median of each, the median of the per-round
differences, and the rounds the chain won.

    python -m benchmarks.decode_chain --threads 2 --quantization none int8 w4a8 --batch 1 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.model_folders import preset_folder
from benchmarks.report import environment, format_table, write_results
from services import Engine, SamplingParams
from services.engine_config import QUANTIZATIONS


def alternate(engine: Engine, rounds: int) -> dict[str, list[float]]:
    """ms of `rounds` decode steps with the chain and as many with the loop, alternated (which goes first swaps)."""
    model = engine.runner.model
    chains, times = model.chains, {"loop": [], "chain": []}
    for r in range(rounds):
        for name in ("loop", "chain") if r % 2 == 0 else ("chain", "loop"):
            model.chains = chains if name == "chain" else None
            start = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    model.chains = chains
    return times


def measure(args, quantization: str | None, batch: int) -> dict:
    engine = Engine(model=preset_folder(args.preset), dtype=args.dtype, num_threads=args.threads,
                    max_num_seqs=batch, kv_cache_memory_gb=2.0, max_model_len=args.context + 2 * args.rounds + 16,
                    quantization=quantization)
    if engine.runner.model.chains is None:
        raise SystemExit("this engine takes the loop for its decode steps (no native build, or a model or plan the "
                         "chain leaves to the loop): nothing to compare")
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=2 * args.rounds + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(4, engine.model_config.vocab_size) for _ in range(args.context)],
                           params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode step builds the chain
    times = alternate(engine, args.rounds)
    differences = [a - b for a, b in zip(times["loop"], times["chain"])]
    return {"quantization": quantization or "none", "batch": batch, "loop_ms": statistics.median(times["loop"]),
            "chain_ms": statistics.median(times["chain"]), "difference_ms": statistics.median(differences),
            "chain_won": sum(d > 0 for d in differences), "rounds": args.rounds, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=["none", *QUANTIZATIONS])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=500, help="prompt tokens per sequence (default 500)")
    parser.add_argument("--rounds", type=int, default=30, help="alternated rounds (default 30)")
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1 or args.context < 1 or min(args.batch) < 1:
        parser.error("--threads, --rounds, --context and --batch must be at least 1")
    torch.set_num_threads(args.threads)
    env = environment()
    print(f"{env['cpu']}, {args.threads} threads, {args.preset} {args.dtype}, contexts {args.context}")
    results = [measure(args, None if q == "none" else q, b) for q in args.quantization for b in args.batch]
    print(format_table(["weights", "batch", "loop ms", "chain ms", "loop - chain", "chain won"],
                       [[r["quantization"], r["batch"], r["loop_ms"], r["chain_ms"], r["difference_ms"],
                         f"{r['chain_won']}/{r['rounds']}"] for r in results]))
    path = write_results("decode_chain", {"environment": env, "args": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
