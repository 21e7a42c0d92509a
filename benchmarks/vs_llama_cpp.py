"""pdserve's engine against the tools a CPU user would pick, on the same weights, in one sitting.

The `1b` preset (random weights, bf16 safetensors) and GGUF files of exactly those weights (f16,
Q8_0; Q4_0 and Q4_K_M as llama.cpp's `llama-quantize` makes them, the output matrix in Q6_K, and `q4_0-pure`, every
matrix Q4_0; `benchmarks/llama_gguf.py`) are timed in interleaved rounds, so a noisy moment of this
shared host hits every system alike:
- batch-1 decode: ms per token after a 128-token prompt (pdserve: `engine.step()`; llama.cpp:
  `Llama.eval([token])`; transformers: one forward with its KV cache);
- prefill of a 1,024-token prompt (first token included);
- batch-32 decode with 1,024-token contexts (pdserve only: 32 sequences admitted with random KV,
  as a decode worker admits prefilled ones; llama-cpp-python's high-level API has one sequence).
`--pdserve-gguf int4:q4_k_m` adds pdserve serving llama.cpp's Q4_K_M file itself (the same bits as llama.cpp's run
of it, converted once, each matrix in the format that holds it: docs/models.md).
Each round takes every system's decode sample back to back (in reverse order every other round), then the prefills:
pdserve's and llama.cpp's batch-1 decode of the same bits (bf16 / f16, int8 / Q8_0, 4-bit / Q4_0) are compared round
by round, seconds apart, since a single round of either moves by 1.5x with this host's neighbours.
The read-bandwidth and matmul ceilings are measured in the same run; the table gives each decode's
MBU (bytes one step reads / its time / read bandwidth; llama.cpp's bytes: its GGUF file) two ways:
against the run's best ceiling, and paired — each round's sample against a read ceiling re-measured
right after it, median over rounds (this VM's bandwidth swings 1.5x within minutes; pairing cancels
that) — and the batch-32 step against (weights + KV bytes) / read bandwidth.

Needs the `bench` extra, llama.cpp built on this host with its native flags (2 cores: ~10 min):
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python -e '.[bench]'
    python -m benchmarks.vs_llama_cpp --threads 2 --rounds 3
On an Intel CPU with AMX that build dies of SIGILL (llama.cpp asks for the AMX tile state on its main thread only):
add "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" and the same CMAKE_CXX_FLAGS to CMAKE_ARGS.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import ceilings as ceilings_mod
from benchmarks import instruction_rates
from benchmarks.bench_runners import PROMPT, LlamaCppRunner, PdserveRunner, TransformersRunner
from benchmarks.llama_gguf import TYPES as GGUF_TYPES
from benchmarks.llama_gguf import gguf_file
from benchmarks.model_folders import CACHE_DIR, describe, preset_folder
from benchmarks.report import environment, format_table, write_results
from services.engine_config import QUANTIZATIONS
from services.kernels.onednn_packs import available_memory_bytes
from services.model_config import ModelConfig

# What the rounds need beyond the loaded systems: the read ceilings' 2 GB buffers (a copy: two), llama.cpp's and
# transformers' prefill buffers. With all nine systems of the `1b` preset loaded, a 24 GB host ran out in round 3.
ROUNDS_ROOM_BYTES = 6 << 30


# pdserve's modes and llama.cpp's GGUF types of the same weight bits
SAME_BITS = {"float32": ("f16",), "bfloat16": ("f16",), "int8": ("q8_0",), "w8a8": ("q8_0",),
             "int4": ("q4_0", "q4_0-pure", "q4_k_m"), "w4a8": ("q4_0", "q4_0-pure", "q4_k_m")}


def same_bits_pairs(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """Each pdserve mode against llama.cpp's of the same bits, round by round (their decode samples taken seconds
    apart): llama.cpp's ms / pdserve's — above 1, pdserve faster — with the median and the rounds pdserve won."""
    pairs = {}
    named = [(f"pdserve {mode}", qtype) for mode, qtypes in SAME_BITS.items() for qtype in qtypes]
    named += [(name, name.rpartition(" on ")[2]) for name in samples if name.startswith("pdserve ") and " on " in name]
    for name, qtype in named:  # "pdserve int4 on q4_k_m": pdserve serving that very file
        ours, theirs = samples.get(name), samples.get(f"llama.cpp {qtype}")
        if ours and theirs:
            ratios = [t / o for o, t in zip(ours["decode_ms"], theirs["decode_ms"])]
            pairs[f"{name} vs llama.cpp {qtype}"] = {"ratios": ratios, "median": statistics.median(ratios),
                                                             "pdserve_faster": sum(r > 1 for r in ratios)}
    return pairs


def memory_warning(left: int | None) -> str | None:
    """What to say when `left` bytes of memory (None: unknown) remain with every system loaded, if too few."""
    if left is None or left >= ROUNDS_ROOM_BYTES:
        return None
    return (f"warning: {left / 2**30:.1f} GiB of memory left with every system loaded, and the rounds need about "
            f"{ROUNDS_ROOM_BYTES / 2**30:.0f}: the kernel may kill this run before its table; run fewer systems at "
            "once (e.g. --pdserve bfloat16 int8 w8a8 --llama-cpp f16 q8_0, then --pdserve int4 w4a8 --llama-cpp q4_0)")


def read_bytes(runner) -> int:
    """Bytes one batch-1 decode step reads (weights + the short context's KV); 0: not known (transformers)."""
    if isinstance(runner, PdserveRunner):
        return runner.decode_bytes([len(PROMPT) + 8])
    return getattr(runner, "weight_bytes", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--pdserve", nargs="*", default=["bfloat16", "int8", "int4"],
                        choices=["float32", "bfloat16", *QUANTIZATIONS],
                        help="pdserve modes: float32, bfloat16, int8 / int4 / w8a8 / w4a8 (bf16 compute; int8 / "
                             "int4 weights; w8a8 / w4a8: int8 / int4 weights and int8 activations)")
    parser.add_argument("--llama-cpp", nargs="*", default=["f16", "q8_0", "q4_0"], choices=GGUF_TYPES,
                        help="GGUF types (default f16 q8_0 q4_0; q4_0 and q4_k_m: llama-quantize's, output in Q6_K; "
                             "q4_0-pure: every matrix Q4_0; the flag alone: no llama.cpp)")
    parser.add_argument("--pdserve-gguf", nargs="*", default=[], metavar="MODE:TYPE",
                        help="pdserve serving llama.cpp's GGUF file of that type itself, e.g. int4:q4_k_m (its Q4_K "
                             "matrices in int4, its Q6_K ones in int8: docs/models.md), paired with llama.cpp's run "
                             "of the same file")
    parser.add_argument("--transformers", nargs="*", default=["bfloat16"], choices=["bfloat16", "float32"],
                        help="dtypes for transformers (default bfloat16; the flag alone: no transformers)")
    parser.add_argument("--batch-steps", type=int, default=6, help="timed batch-32 decode steps per round")
    args = parser.parse_args()
    served_files = [spec.partition(":")[::2] for spec in args.pdserve_gguf]
    for spec, (mode, qtype) in zip(args.pdserve_gguf, served_files):
        if mode not in QUANTIZATIONS or qtype not in GGUF_TYPES:
            parser.error(f"--pdserve-gguf takes MODE:TYPE, MODE one of {', '.join(QUANTIZATIONS)} and TYPE one of "
                         f"{', '.join(GGUF_TYPES)}; got {spec!r}")
    torch.set_num_threads(args.threads)
    folder = preset_folder("1b")
    config = ModelConfig.from_folder(folder)
    print(f"1b preset: {describe(config)}; {environment()['cpu']}, {args.threads} threads", flush=True)
    runners = {}
    for mode in args.pdserve:
        dtype, quantization = ("bfloat16", mode) if mode in QUANTIZATIONS else (mode, None)
        runners[f"pdserve {mode}"] = PdserveRunner(folder, dtype, quantization)
    for mode, qtype in served_files:
        print(f"pdserve {mode} on the GGUF {qtype} ...", flush=True)
        runners[f"pdserve {mode} on {qtype}"] = PdserveRunner(gguf_file(folder, CACHE_DIR, qtype), "bfloat16", mode)
    for qtype in args.llama_cpp:
        print(f"GGUF {qtype} ...", flush=True)
        runners[f"llama.cpp {qtype}"] = LlamaCppRunner(gguf_file(folder, CACHE_DIR, qtype), args.threads)
    for dtype in args.transformers:
        runners[f"transformers {dtype}"] = TransformersRunner(folder, getattr(torch, dtype))
    if warning := memory_warning(available_memory_bytes()):
        print(warning, flush=True)
    before = ceilings_mod.measure(num_bytes=2 * 10**9, repeats=3)
    probe = ceilings_mod.ReadProbe(10**9)  # re-measured after each decode sample: the paired MBU
    samples = {name: {"decode_ms": [], "prefill_ms": [], "batch32_ms": []} for name in runners}
    paired_mbu = {name: [] for name in runners}
    for round_ in range(args.rounds):
        order = list(runners) if round_ % 2 == 0 else list(reversed(runners))  # no system always first
        for name in order:  # the decode samples back to back: the pairs below compare moments seconds apart
            runner = runners[name]
            samples[name]["decode_ms"].append(runner.decode_ms(args.decode_tokens))
            if read_bytes(runner):
                paired_mbu[name].append(read_bytes(runner) / (samples[name]["decode_ms"][-1] / 1e3) / probe(2))
        for name in order:
            runner = runners[name]
            samples[name]["prefill_ms"].append(runner.prefill_ms())
            if isinstance(runner, PdserveRunner):
                samples[name]["batch32_ms"].append(runner.batch_decode_ms(32, 1024, args.batch_steps))
            print(f"round {round_ + 1}: {name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples[name].items()
                                                              if v), flush=True)
    after = ceilings_mod.measure(num_bytes=2 * 10**9, repeats=3)
    read_bw = max(before["read_gbps"], after["read_gbps"]) * 1e9
    rates = dict(instruction_rates.build().instruction_rates(args.threads, 2 * 10**7, 3))  # {} without AVX2
    # MACs/ns of the fastest multiply: a vector idiom's, or the bf16 matmul's where it is faster (AMX tiles, which
    # instruction_rates does not time: 2.4 TFLOP/s on 2 threads of an Intel Xeon, family 6 model 207, against
    # vpdpbusd's 0.67 T multiply-accumulates a second)
    matmul_macs = max(before["matmul_flops"]["bfloat16"], after["matmul_flops"]["bfloat16"]) / 2 / 1e9
    fastest = max([*rates.values(), matmul_macs]) if rates else 0.0
    fastest_name = "bf16 matmul" if fastest == matmul_macs else "multiply idiom"
    rows, results = [], {}
    for name, s in samples.items():
        med = {k: statistics.median(v) for k, v in s.items() if v}
        spread = {k: (min(v), max(v)) for k, v in s.items() if v}
        entry = {"median": med, "min_max": spread}
        runner = runners[name]
        mbu, paired, batch_bound = "", "", ""
        if read_bytes(runner):
            mbu, paired = read_bytes(runner) / (med["decode_ms"] / 1e3) / read_bw, statistics.median(paired_mbu[name])
            entry.update(decode_mbu=mbu, decode_mbu_paired=paired, decode_mbu_paired_rounds=paired_mbu[name])
        if isinstance(runner, PdserveRunner):
            bound = runner.decode_bytes([1024 + 4] * 32) / read_bw * 1e3
            batch_bound = med["batch32_ms"] / bound
            entry.update(batch32_vs_bandwidth_bound=batch_bound, batch32_bound_ms=bound)
            if fastest:
                floor = runner.engine.runner.cost.prefill_flops([1] * 32, [1024 + 4] * 32, 32) / 2 / fastest / 1e6
                batch_bound = f"{batch_bound:.2f}x bound, {med['batch32_ms'] / floor:.2f}x compute floor"
                entry.update(batch32_compute_floor_ms=floor, batch32_vs_compute_floor=med["batch32_ms"] / floor)
            else:
                batch_bound = f"{batch_bound:.2f}x bound"
        results[name] = entry
        rows.append([name, f"{med['decode_ms']:.1f} [{spread['decode_ms'][0]:.1f}-{spread['decode_ms'][1]:.1f}]",
                     mbu if mbu == "" else f"{mbu:.2f}", paired if paired == "" else f"{paired:.2f}",
                     f"{med['prefill_ms'] / 1e3:.2f} s",
                     f"{med['batch32_ms']:.0f} ({batch_bound})" if "batch32_ms" in med else "-"])
    print(format_table(["system", "batch-1 decode ms/token [min-max]", "MBU", "MBU paired", "prefill 1,024",
                        "batch-32 x 1,024-ctx step ms"], rows))
    print(f"read ceiling {read_bw / 1e9:.1f} GB/s (best of sum, GEMV, native GEMV; before and after); bf16 matmul "
          f"{before['matmul_flops']['bfloat16'] / 1e9:.0f} GFLOP/s; the compute floor: {fastest:.0f} MACs/ns, the "
          f"{fastest_name}'s (the fastest of benchmarks.instruction_rates' idioms and the bf16 matmul)")
    pairs = same_bits_pairs(samples)
    for pair, p in pairs.items():
        print(f"{pair}, batch-1 decode, llama.cpp's ms / pdserve's per round: "
              f"{' / '.join(f'{r:.2f}' for r in p['ratios'])}; median {p['median']:.2f}, pdserve faster in "
              f"{p['pdserve_faster']} of {len(p['ratios'])}")
    path = write_results("vs_llama_cpp", {"environment": environment(), "model": describe(config),
                                          "ceilings": {"before": before, "after": after},
                                          "instruction_rates": rates, "results": results,
                                          "same_bits_pairs": pairs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
