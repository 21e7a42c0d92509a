"""Offline generation throughput: pdserve's `Engine.generate` against Hugging Face transformers'
`generate` on the same model, dtype and threads, in the same run.

Workload: `--num-prompts` prompts of `--prompt-len` random token ids (fixed seeds; fresh prompts in
every round, so pdserve's prefix cache gets no hits), `--output-len` greedy output tokens each, EOS
ignored. pdserve gets all prompts at once (continuous batching);
transformers runs static batches of each `--hf-batch-sizes` size over the same prompts
(min_new_tokens = max_new_tokens, so every row produces exactly `--output-len` tokens) and its best
batch size is the comparison. Throughput = output tokens / wall time of the whole workload, after
one small untimed warm-up of each system. Both systems stay loaded; after one run of every HF batch
size, pdserve and HF's best batch size run alternately `--rounds` times and the ratio is the median of
the per-round ratios. Each run waits for a quiet machine first and reports how many cores other
processes kept busy while it ran.

    python -m benchmarks.offline_throughput --threads 2 --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.cpu_contention import CpuMeter, wait_for_quiet
from benchmarks.model_folders import describe, preset_folder
from benchmarks.report import environment, format_table, write_results
from services import Engine, SamplingParams
from services.model_config import ModelConfig

TARGET_RATIO = 2.0  # issue 9: 3x was beyond this host's roofline


def make_prompts(seed: int, num_prompts: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]  # 0..3: specials


def timed(fn) -> tuple[float, float, object]:
    """(seconds, foreign cores, result) of `fn()`, after waiting for a quiet machine."""
    wait_for_quiet()
    with CpuMeter() as meter:
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
    return elapsed, meter.foreign_cores, result


def pdserve_workload(folder, dtype: str, threads: int, warmup: list[list[int]], output_len: int, device: str):
    """A callable `run(prompts)` that runs a workload through one warmed-up Engine; returns output ids."""
    engine = Engine(model=folder, dtype=dtype, num_threads=threads, max_num_seqs=64, max_num_batched_tokens=2048,
                    max_model_len=len(warmup[0]) + output_len + 16, device=device)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.generate([p[:16] for p in warmup], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))

    def run(prompts: list[list[int]]) -> list[list[int]]:
        outs = engine.generate(prompts, params)
        assert all(len(o.token_ids) == output_len for o in outs)
        return [list(o.token_ids) for o in outs]

    return run


def hf_workload(folder, dtype: str, warmup: list[list[int]], output_len: int, device: str):
    """A callable `run(prompts, batch_size)` that runs a workload through transformers in static batches."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    @torch.inference_mode()
    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        input_ids = torch.tensor(batch, device=device)  # equal-length prompts: no padding
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)
        return out[:, input_ids.shape[1]:].tolist()

    generate([p[:16] for p in warmup], 4)
    return lambda prompts, size: [row for i in range(0, len(prompts), size)
                                  for row in generate(prompts[i : i + size], output_len)]


def measure_dtype(folder, dtype: str, vocab_size: int, args) -> dict:
    """Every HF batch size once, then `args.rounds` alternating runs of pdserve and HF's best batch size.
    Each round draws fresh prompts (both systems get the same), so pdserve's prefix cache never hits."""
    def prompts_for(round_index: int) -> list[list[int]]:
        return make_prompts(args.seed + round_index, args.num_prompts, args.prompt_len, vocab_size)

    num_tokens = args.num_prompts * args.output_len
    warmup = make_prompts(args.seed + 10_000, 2, args.prompt_len, vocab_size)
    ours = pdserve_workload(folder, dtype, args.threads, warmup, args.output_len, args.device)
    theirs = hf_workload(folder, dtype, warmup, args.output_len, args.device)
    by_batch = {}
    for size in args.hf_batch_sizes:
        seconds, foreign, _ = timed(lambda: theirs(prompts_for(0), size))  # noqa: B023 (called at once)
        by_batch[size] = {"seconds": seconds, "tokens_per_s": num_tokens / seconds, "foreign_cores": foreign}
        print(f"  transformers batch {size:>3}: {num_tokens / seconds:.1f} tok/s", flush=True)
    best = max(by_batch, key=lambda b: by_batch[b]["tokens_per_s"])
    rounds = []
    for i in range(1, args.rounds + 1):
        prompts = prompts_for(i)
        ours_s, ours_foreign, our_ids = timed(lambda: ours(prompts))  # noqa: B023
        hf_s, hf_foreign, hf_ids = timed(lambda: theirs(prompts, best))  # noqa: B023
        rounds.append({"pdserve_s": ours_s, "pdserve_foreign_cores": ours_foreign, "hf_s": hf_s,
                       "hf_foreign_cores": hf_foreign, "ratio": hf_s / ours_s})
        print(f"  round: pdserve {num_tokens / ours_s:.1f} tok/s, transformers batch {best} "
              f"{num_tokens / hf_s:.1f} tok/s, ratio {hf_s / ours_s:.2f}", flush=True)
    med = statistics.median
    ratio = med(r["ratio"] for r in rounds)
    return {"dtype": dtype, "hf_by_batch": by_batch, "hf_best_batch": best, "rounds": rounds,
            "pdserve_tokens_per_s": num_tokens / med(r["pdserve_s"] for r in rounds),
            "hf_best_tokens_per_s": num_tokens / med(r["hf_s"] for r in rounds), "ratio": ratio,
            "identical_outputs": sum(a == b for a, b in zip(our_ids, hf_ids)), "target_ratio": TARGET_RATIO,
            "pass": ratio >= TARGET_RATIO}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="dtypes to measure (default float32)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both systems (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N], for both systems (default cpu)")
    parser.add_argument("--preset", default="small", help="model preset (default small, ~125M params)")
    parser.add_argument("--num-prompts", type=int, default=32, help="number of prompts (default 32)")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt length in tokens (default 256)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per prompt (default 64)")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32],
                        help="static batch sizes tried for transformers; its best counts (default 1 8 16 32)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating runs of pdserve and HF's best batch size (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = preset_folder(args.preset)
    config = ModelConfig.from_folder(folder)
    shape = describe(config)
    results, rows = [], []
    for dtype in args.dtype:
        print(f"{args.preset} ({shape}); device={args.device}; dtype={dtype}; threads={args.threads}", flush=True)
        r = measure_dtype(folder, dtype, config.vocab_size, args)
        results.append(r)
        for size, b in r["hf_by_batch"].items():
            rows.append([dtype, f"transformers generate, static batch {size}", "1", b["tokens_per_s"],
                         f"{b['foreign_cores']:.2f}", "", "", ""])
        foreign = max(max(x["pdserve_foreign_cores"], x["hf_foreign_cores"]) for x in r["rounds"])
        rows.append([dtype, f"transformers generate, static batch {r['hf_best_batch']} (best)", str(args.rounds),
                     r["hf_best_tokens_per_s"], f"{foreign:.2f}", "1.00x", "", ""])
        rows.append([dtype, "pdserve Engine.generate", str(args.rounds), r["pdserve_tokens_per_s"], f"{foreign:.2f}",
                     f"{r['ratio']:.2f}x", f">= {TARGET_RATIO:.0f}x", "PASS" if r["pass"] else "FAIL"])
    print(f"\n{args.preset} ({shape}); device={args.device}; threads={args.threads}; {args.num_prompts} prompts x {args.prompt_len} "
          f"tokens -> {args.output_len} greedy tokens each")
    print(format_table(["dtype", "system", "runs", "output tok/s", "foreign cores", "vs best HF", "target", ""],
                       rows))
    print("runs > 1: median of alternating runs; the ratio is the median of the per-round ratios. foreign cores: "
          "most cores other processes kept busy during a run (0 = quiet)")
    for r in results:
        print(f"{r['dtype']}: {r['identical_outputs']}/{args.num_prompts} greedy outputs identical between pdserve and "
              f"transformers (random weights give flat distributions, so float-rounding ties can differ)")
    payload = {"environment": environment(), "preset": args.preset, "model_shape": shape, "args": vars(args),
               "results": results}
    print(f"wrote {write_results('offline_throughput', payload)}")


if __name__ == "__main__":
    main()
