"""Every product the kernel plan could pick for a 4-bit weight — int4's candidates and w4a8's — timed side by side
on the `1b` preset's shapes at a decode step's, a batch's and a prefill's row counts: milliseconds (best of the
interleaved rounds) and multiply-accumulates per ns, from the caches (each weight timed repeatedly; a decode step
reads it from memory, so few-row figures are upper bounds there).

    python -m benchmarks.four_bit_products --threads 2
    PDSERVE_NATIVE_MARCH=znver3 python -m benchmarks.four_bit_products   # an AVX2 CPU's kernels on a newer one
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.ceilings import best_time
from benchmarks.report import environment, format_table, write_results
from services.int4_weight import Int4Weight
from services.kernels import native as native_build
from services.kernels.linear_candidates import candidates
from services.w4a8_weight import W4A8Weight

SHAPES = {"gate_up": (16384, 2048), "down": (2048, 8192), "qkv": (3072, 2048)}  # the `1b` preset's (N, K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 1024])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the best counts (default 5)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="x's dtype")
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1 or min(args.rows) < 1:
        parser.error("--threads, --rounds and --rows must be at least 1")
    torch.set_num_threads(args.threads)
    native, dtype = native_build.load(), getattr(torch, args.dtype)
    env = {**environment(), "march": native_build.cflags()[1], "native": native is not None, "x": args.dtype}
    kernels = env["march"] if native else "none (torch only)"
    print(f"{env['cpu']}, {args.threads} threads, kernels {kernels}, x {args.dtype}")
    rows_out, results = [], []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        weights = {"int4": Int4Weight.quantize(w), "w4a8": W4A8Weight.quantize(w)}
        for rows in args.rows:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            calls = {f"{fmt} {name}": (lambda f=fn, wt=weights[fmt], x=x: f(x, wt, None))
                     for fmt in weights
                     for name, fn in candidates(fmt, True, k, rows, native, packed=True, compute=dtype).items()}
            times = {name: [] for name in calls}
            for _ in range(args.rounds):  # interleaved: a noisy moment hits every kernel alike
                for name, call in calls.items():
                    times[name].append(best_time(call, 1) * 1e3)
            for name, ts in times.items():
                ms = min(ts)
                rate = rows * n * k / ms / 1e6
                rows_out.append([f"{shape} {n}x{k}", rows, name, ms, rate])
                results.append({"shape": shape, "n": n, "k": k, "rows": rows, "kernel": name, "ms": ms,
                                "mac_per_ns": rate})
    print(format_table(["weight", "rows", "kernel", "ms", "MAC/ns"], rows_out))
    print(f"wrote {write_results('four_bit_products', {'environment': env, 'results': results})}")


if __name__ == "__main__":
    main()
