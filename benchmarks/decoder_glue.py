"""The element-wise glue between a decoder layer's products (services/kernels/decoder_glue.py): the native pass
against torch's operators, each timed two ways in interleaved rounds — warm (called again and again), and right after
a decode product has streamed a 64 MB weight through the caches, as a decode step calls it (the next operator's code
and data then come back from memory). Microseconds, median [min-max]; `1b` shapes by default.

    python -m benchmarks.decoder_glue --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.report import environment, format_table, write_results
from services.kernels import native as native_build
from services.kernels.decoder_glue import DecoderGlue

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def operators(glue: DecoderGlue, rows: int, args, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """One call of each glue operator on `rows` rows of the model's shapes."""
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * args.intermediate, generator=g).to(dtype)
    h = torch.randn(rows, args.hidden, generator=g).to(dtype)
    delta, weight = torch.randn_like(h), torch.ones(args.hidden, dtype=dtype)
    heads = torch.randn(rows, args.heads, args.head_dim, generator=g).to(dtype)  # q and k heads together
    angle = torch.rand(rows, 1, args.head_dim // 2, generator=g) * 3.14
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin_signed = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
    return {"silu_mul": lambda: glue.silu_mul(gate_up),
            "residual_norm": lambda: glue.residual_norm(h, delta, weight, 1e-5),
            "rotate": lambda: glue.rotate(heads, cos, sin_signed)}


def stream_product(native, hidden: int, dtype: torch.dtype) -> Callable[[], object]:
    """A decode product over a 64 MB weight (one row of x), natively where the build has it."""
    w = torch.randn(64 * 2**20 // (hidden * torch.finfo(dtype).bits // 8), hidden).to(dtype)
    x = torch.randn(1, hidden).to(dtype)
    if native is not None:
        return lambda: native.skinny_linear(x, w, None, None)
    return lambda: F.linear(x, w)


def timed(fn: Callable[[], object], before: Callable[[], object] | None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 1024])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=40, help="q + k heads rotated (default 40: 32 + 8)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if min(args.threads, args.rounds, args.hidden, args.intermediate, args.heads, min(args.rows)) < 1 or \
            args.head_dim < 2 or args.head_dim % 2:
        parser.error("--threads, --rounds, --rows and the shapes must be at least 1, --head-dim even")
    torch.set_num_threads(args.threads)
    native = native_build.load()
    if native is None:
        raise SystemExit("the native kernels could not be built on this host (see the log line above)")
    dtype = DTYPES[args.dtype]
    product = stream_product(native, args.hidden, dtype)
    load_before = os.getloadavg()
    rows, results = [], []
    with torch.inference_mode():
        for num_rows in args.rows:
            calls = {path: operators(DecoderGlue(native if path == "native" else None), num_rows, args, dtype)
                     for path in ("torch", "native")}
            conditions = {"warm": None, "after a product": product} if num_rows <= 64 else {"warm": None}
            for name in calls["torch"]:
                for condition, before in conditions.items():
                    times: dict[str, list[float]] = {"torch": [], "native": []}
                    for path in times:
                        calls[path][name]()  # warm-up
                    for r in range(args.rounds):  # interleaved, the order swapped every round
                        for path in ("torch", "native") if r % 2 == 0 else ("native", "torch"):
                            times[path].append(timed(calls[path][name], before))
                    med = {path: statistics.median(t) for path, t in times.items()}
                    rows.append([name, num_rows, condition,
                                 *(f"{med[p] * 1e6:.1f} [{min(t) * 1e6:.1f}-{max(t) * 1e6:.1f}]" for p, t in times.items()),
                                 med["torch"] / med["native"]])
                    results.append({"operator": name, "rows": num_rows, "condition": condition,
                                    "us": {p: [x * 1e6 for x in t] for p, t in times.items()},
                                    "speedup": med["torch"] / med["native"]})
    env = environment()
    load = (load_before, os.getloadavg())
    print(f"{env['cpu']}, {args.threads} threads, {args.dtype}, load average {load[0][0]:.2f} before / "
          f"{load[1][0]:.2f} after; silu_mul native: {hasattr(native, 'silu_mul')}")
    print(format_table(["operator", "rows", "when", "torch us", "native us", "speedup"], rows))
    path = write_results("decoder_glue", {"environment": env, "args": vars(args), "load_average": load,
                                          "results": results})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
