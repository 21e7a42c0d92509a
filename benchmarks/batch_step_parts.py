"""The parts of a batched decode step, each by every kernel this host has for it, side by side: the `1b` preset's
products for bf16, int8 and int4 weights at a batch's row counts (every candidate the kernel plan would time), and one layer's
decode attention over 32 sequences x 1,024 tokens by each native path (AMX tiles, bf16 pairs). Weights and pools are
read from memory, as a decode step reads them: each call takes the next of several copies, together past the last-level
cache. Interleaved rounds, median milliseconds; GB/s of weights (or KV) read.

    python -m benchmarks.batch_step_parts --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.report import environment, format_table, write_results
from services.int4_weight import Int4Weight
from services.kernels import native as native_build
from services.kernels.linear_candidates import candidates
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.quantized_weight import Int8Weight

SHAPES = {"gate_up": (16384, 2048), "down": (2048, 8192), "qkv": (3072, 2048), "o": (2048, 2048)}  # 1b's (N, K)
COPIES_BYTES = 700 * 2**20  # the copies a kernel cycles through: past a 300 MB L3


def cycled(calls: dict, rounds: int, copies: int) -> dict[str, float]:
    """{name: median ms of one call}, each round every kernel once through its copies, in turn."""
    times = {name: [] for name in calls}
    for call in calls.values():
        call(0)  # warm-up: packs, buffers
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for i in range(copies):
                call(i)
            times[name].append((time.perf_counter() - start) / copies * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def products(native, shape: str, rows: list[int], rounds: int) -> list[dict]:
    n, k = SHAPES[shape]
    copies = max(2, COPIES_BYTES // (n * k * 2))
    dense = [torch.randn(n, k).bfloat16() for _ in range(copies)]
    weights = {"bfloat16": dense, "int8": [Int8Weight.quantize(w.float()) for w in dense],
               "int4": [Int4Weight.quantize(w.float()) for w in dense]}
    out = []
    for rows_ in rows:
        x = torch.randn(rows_, k).bfloat16()
        calls = {}
        for fmt, ws in weights.items():
            for name, fn in candidates(fmt, True, k, rows_, native, packed=True, compute=torch.bfloat16).items():
                calls[f"{fmt} {name}"] = lambda i, f=fn, ws=ws, x=x: f(x, ws[i], None)
        for name, ms in cycled(calls, rounds, copies).items():
            fmt = name.split()[0]
            gb = n * k * {"bfloat16": 2, "int8": 1, "int4": 0.625}[fmt] / 1e9  # int4: its group parameters too
            out.append({"part": f"{shape} {n}x{k}", "rows": rows_, "kernel": name, "ms": ms, "gbps": gb / ms * 1e3})
        for ws in weights.values():
            for w in ws:
                if isinstance(w, torch.Tensor):
                    ONEDNN_PACKS.drop(w)
    return out


def attention(native, rounds: int) -> list[dict]:
    if not hasattr(native, "set_decode_attention_tiles"):
        return []
    seqs, heads, kv_heads, head_dim, block, context = 32, 32, 8, 64, 16, 1024
    blocks = seqs * context // block
    pool_bytes = 2 * blocks * block * kv_heads * head_dim * 2
    pools = [torch.randn(2, blocks * block, kv_heads, head_dim).bfloat16()
             for _ in range(max(2, COPIES_BYTES // pool_bytes))]
    q = torch.randn(seqs, heads, head_dim).bfloat16()
    tables, lens = torch.randperm(blocks).view(seqs, -1), torch.full((seqs,), context)

    def path(on: bool):
        def call(i: int) -> None:
            native.set_decode_attention_tiles(on)
            native.paged_decode_attention(q, pools[i], tables, lens, block, head_dim**-0.5)
        return call

    timed = cycled({"tiles (decode_tiles.h)": path(True), "pairs (decode_pairs.h)": path(False)}, rounds, len(pools))
    native.set_decode_attention_tiles(True)
    return [{"part": "decode attention 32 x 1,024, one layer", "rows": seqs, "kernel": name, "ms": ms,
             "gbps": pool_bytes / 1e9 / ms * 1e3} for name, ms in timed.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median counts (default 5)")
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1 or min(args.rows) < 2:
        parser.error("--threads and --rounds must be at least 1, --rows at least 2 (a batch)")
    torch.set_num_threads(args.threads)
    native = native_build.load()
    env = {**environment(), "native": native is not None}
    print(f"{env['cpu']}, {args.threads} threads, native kernels {'built' if native else 'off'}", flush=True)
    results = attention(native, args.rounds) if native else []
    for shape in args.shapes:
        results += products(native, shape, args.rows, args.rounds)
    print(format_table(["part", "rows", "kernel", "ms", "GB/s"],
                       [[r["part"], r["rows"], r["kernel"], r["ms"], r["gbps"]] for r in results]))
    print(f"wrote {write_results('batch_step_parts', {'environment': env, 'results': results})}")


if __name__ == "__main__":
    main()
