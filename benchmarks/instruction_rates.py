"""How fast this CPU's vector instructions multiply and add, on the threads a worker uses, and the floor
that sets on a compute-bound phase.

A prefill (and a batch-32 decode step on a CPU without 16-bit arithmetic) is bound by arithmetic, not
by bytes: whatever a kernel does, it cannot beat (its multiply-accumulates) / (the rate of the
instructions it multiplies with). `instruction_rates.cpp`, compiled here with `-march=native`, runs
each idiom from registers on every thread and reports the best of a few runs; the table gives, per
idiom, that rate and the shortest a `--tokens` prefill of `--preset` could take with it (the same
FLOP count the engine's roofline uses, `services/roofline.py`). Comparing a measured prefill with
these floors says how far from the ceiling it runs, and which speed-ups are possible at all: with
float32 FMAs (the only float arithmetic of an AVX2 CPU) a system already at half the floor's rate
cannot be beaten twofold.

    python -m benchmarks.instruction_rates --threads 2 --preset 1b --tokens 1024
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.report import environment, format_table, write_results
from services.cache_folder import cache_root
from services.model_presets import PRESETS
from services.roofline import ModelCost


def build():
    """The compiled probe (cached under the pdserve cache folder; ~20 s the first time)."""
    from torch.utils.cpp_extension import load

    folder = cache_root() / "instruction_rates"
    folder.mkdir(parents=True, exist_ok=True)
    return load(name="pdserve_instruction_rates", sources=[str(Path(__file__).with_suffix(".cpp"))],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                build_directory=str(folder))


def _flop_cost(preset: str) -> ModelCost:
    c = PRESETS[preset].model_config()
    return ModelCost(layer_matmul_params=c.num_layers * c.layer_matmul_params, lm_head_params=c.vocab_size * c.hidden_size,
                     weight_bytes=0, attention_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim,
                     kv_bytes_per_token=0)


def prefill_macs(preset: str, tokens: int) -> int:
    """Multiply-accumulates of one `tokens`-long prefill of `preset` (its first token sampled)."""
    return _flop_cost(preset).prefill_flops([tokens], [tokens], 1) // 2


def decode_step_macs(preset: str, batch: int, context: int) -> int:
    """Multiply-accumulates of one decode step of `batch` sequences, each attending to `context` tokens."""
    return _flop_cost(preset).prefill_flops([1] * batch, [context] * batch, batch) // 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="threads, one chain set each (default 2)")
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS), help="model whose prefill floor is given")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length of that prefill (default 1024)")
    parser.add_argument("--batch", type=int, default=32, help="sequences of the decode step whose floor is given")
    parser.add_argument("--context", type=int, default=1024, help="context of each of them (default 1024)")
    parser.add_argument("--steps", type=int, default=20_000_000, help="loop steps a thread per run (default 2e7)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per idiom; the best counts (default 5)")
    args = parser.parse_args()
    for name in ("threads", "tokens", "batch", "context", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    rates = build().instruction_rates(args.threads, args.steps, args.repeats)
    if not rates:
        raise SystemExit("this CPU has no AVX2 and FMA: the probe has no idiom to time here")
    macs = prefill_macs(args.preset, args.tokens)
    step_macs = decode_step_macs(args.preset, args.batch, args.context)
    rows = [{"idiom": name, "macs_per_ns": rate, "gflops": 2 * rate, "prefill_floor_s": macs / rate / 1e9,
             "decode_step_floor_ms": step_macs / rate / 1e6} for name, rate in rates]
    env = environment() | {"num_threads": args.threads}
    step = f"batch-{args.batch} x {args.context:,}-ctx step"
    print(f"cpu={env['cpu']}  threads={args.threads}  {args.preset}: prefill of {args.tokens} tokens "
          f"{macs / 1e9:.0f} G multiply-accumulates, decode {step} {step_macs / 1e9:.1f} G")
    print(format_table(["instruction idiom", "MACs/ns", "GFLOP/s", f"prefill {args.tokens:,} floor s",
                        f"{step} floor ms"],
                       [[r["idiom"], r["macs_per_ns"], r["gflops"], r["prefill_floor_s"], r["decode_step_floor_ms"]]
                        for r in rows]))
    path = write_results("instruction_rates", {"environment": env, "preset": args.preset, "tokens": args.tokens,
                                               "batch": args.batch, "context": args.context, "prefill_macs": macs,
                                               "decode_step_macs": step_macs, "rates": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
