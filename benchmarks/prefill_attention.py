"""Prefill attention on this CPU: torch's path (SDPA on a prompt's fresh k/v, or on its context gathered
out of the pool after a cached prefix) against the native kernel that reads the pool in place
(services/kernels/prefill_attention.cpp). Both run through `paged_attention`, exactly as a model layer
calls it (the new k/v written into the pool first), timed in interleaved rounds; median [min-max].

A shape is tokens:context:heads:kv_heads:head_dim (context > tokens: a chunk after a cached prefix).
GFLOP/s counts the causal half only: 4 * H * Dh * (keys each query sees, summed).

    python -m benchmarks.prefill_attention --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.report import environment, format_table, write_results
from services.attention import AttentionMetadata, paged_attention
from services.kernels import native as native_build

SHAPES = ("1024:1024:32:8:64", "256:256:12:4:64", "256:1280:32:8:64")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
BLOCK_SIZE = 16


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    try:
        tokens, context, heads, kv_heads, head_dim = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be tokens:context:heads:kv_heads:head_dim, got {text!r}") from None
    if min(tokens, heads, kv_heads, head_dim) < 1 or context < tokens or heads % kv_heads:
        raise argparse.ArgumentTypeError(f"shape {text!r}: needs context >= tokens >= 1 and kv_heads dividing heads")
    return tokens, context, heads, kv_heads, head_dim


def layer_call(shape: tuple[int, int, int, int, int], dtype: torch.dtype, prefill_kernel):
    """One layer's attention call for one sequence, its blocks scattered through the pool."""
    tokens, context, heads, kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(0)
    num_blocks = -(-context // BLOCK_SIZE)
    pool = torch.randn(2, num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=g).to(dtype)  # [2, S, K, Dh]
    table = torch.randperm(num_blocks, generator=g)
    slots = (table[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1)[context - tokens : context]
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)  # [T, H, Dh]
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))  # [T, K, Dh]
    meta = AttentionMetadata(slots, [tokens], [context], table[None], BLOCK_SIZE, None)
    return lambda: paged_attention(q, k, v, pool, meta, head_dim**-0.5, None, prefill_kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in SHAPES],
                        help="tokens:context:heads:kv_heads:head_dim (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1:
        parser.error(f"--threads and --rounds must be at least 1, got {args.threads} and {args.rounds}")
    torch.set_num_threads(args.threads)
    native = native_build.load()
    if native is None:
        raise SystemExit("the native kernels could not be built on this host (see the log line above)")
    load_before = os.getloadavg()
    rows, results = [], []
    with torch.inference_mode():
        for shape in args.shapes:
            for dtype_name in args.dtypes:
                tokens, context, heads, kv_heads, head_dim = shape
                calls = {"torch": layer_call(shape, DTYPES[dtype_name], None),
                         "native": layer_call(shape, DTYPES[dtype_name], native.prefill_attention)}
                times: dict[str, list[float]] = {name: [] for name in calls}
                for fn in calls.values():
                    fn()  # warm-up
                for _ in range(args.rounds):  # interleaved: a noisy moment hits both
                    for name, fn in calls.items():
                        start = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - start)
                med = {name: statistics.median(t) for name, t in times.items()}
                flops = 4 * heads * head_dim * (tokens * (context - tokens) + tokens * (tokens + 1) // 2)
                label = f"T{tokens} C{context} H{heads} K{kv_heads} Dh{head_dim} {dtype_name}"
                rows.append([label, *(f"{med[n] * 1e3:.2f} [{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}]"
                                      for n, t in times.items()),
                             med["torch"] / med["native"], flops / med["native"] / 1e9])
                results.append({"shape": dict(zip(("tokens", "context", "heads", "kv_heads", "head_dim"), shape)),
                                "dtype": dtype_name, "ms": {n: [x * 1e3 for x in t] for n, t in times.items()},
                                "speedup": med["torch"] / med["native"], "native_gflops": flops / med["native"] / 1e9})
    env = environment()
    load = (load_before, os.getloadavg())
    print(f"{env['cpu']}, {args.threads} threads, load average {load[0][0]:.2f} before / {load[1][0]:.2f} after")
    print(format_table(["prefill attention", "torch ms", "native ms", "speedup", "native GFLOP/s"], rows))
    path = write_results("prefill_attention", {"environment": env, "load_average": load, "rounds": args.rounds,
                                               "results": results})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
