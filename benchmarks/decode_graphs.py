"""Decode steps from CUDA graphs against eager ones, on the GPU (issue 15's decode goals).

Method. Two engines of the preset (random weights, bf16) on one GPU, built side by side: one with
decode graphs (the default on CUDA: captured at start, that time reported), one with
`enforce_eager`. For each batch size, `batch` requests with `--context`-token random prompts are
prefilled (not timed), then `--steps` decode steps are timed one by one (`engine.step()`, which
waits for the sampled tokens, so each time is the GPU's work plus the host's); medians reported,
with tokens/s = batch / step time. Then one greedy request of each batch is compared token by token
between the two engines (graphs must not change the output).

Goals (H200, 1b, bf16): batch-1 decode <= 2.5 ms/step; batch-32 decode >= 10,000 tokens/s.

    python -m benchmarks.decode_graphs [--preset 1b] [--batch 1 32] [--steps 30] [--context 128]
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


def decode_times(engine: Engine, batch: int, context: int, steps: int, rng: random.Random) -> tuple[float, list[int]]:
    """Median seconds of a decode step of `batch` sequences, and the first request's tokens."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(vocab) for _ in range(context)], params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # prefill: not timed
    assert len(engine.scheduler.running) == batch, "every request must be decoding at once"
    seq = next(s for s in engine.scheduler.running if s.request_id == ids[0])
    engine.step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    tokens = list(seq.token_ids[seq.num_prompt_tokens :])
    for request_id in ids:
        engine.abort(request_id)
    return statistics.median(times), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_graphs needs a CUDA device (CUDA graphs); none is available here")
    folder = preset_folder(args.preset)
    engines, starts = {}, {}
    for name, eager in (("graphs", False), ("eager", True)):
        start = time.perf_counter()
        engines[name] = Engine(model=folder, dtype="bfloat16", device="cuda", enforce_eager=eager,
                               max_num_seqs=max(args.batch), kernels="auto")
        starts[name] = time.perf_counter() - start
    rows, results = [], []
    for batch in args.batch:
        measured = {name: decode_times(e, batch, args.context, args.steps, random.Random(batch))
                    for name, e in engines.items()}
        same = measured["graphs"][1] == measured["eager"][1]
        for name, (step_s, _) in measured.items():
            rows.append([name, batch, step_s * 1e3, batch / step_s, starts[name], "yes" if same else "NO"])
            results.append({"mode": name, "batch": batch, "step_s": step_s, "tokens_per_s": batch / step_s,
                            "engine_start_s": starts[name], "tokens_equal": same})
    print(format_table(["mode", "batch", "step ms", "tokens/s", "engine start s", "same tokens"], rows))
    attention, graphs = engines["graphs"].runner.gpu_decode_attention, engines["graphs"].runner.decode_graphs
    print(f"decode attention: {attention}; graphs: {sorted(graphs.graphs) if graphs else 'none: capture failed'}")
    print(write_results("decode_graphs", {"environment": environment(), "gpu": torch.cuda.get_device_name(),
                                          "preset": args.preset, "decode_attention": attention,
                                          "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
