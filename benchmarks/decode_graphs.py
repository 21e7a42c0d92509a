"""Decode steps from CUDA graphs against eager ones, on the GPU (issue 15's decode goals).

Method. Two engines of the preset (random weights, bf16) on one GPU, built side by side: one with
decode graphs (the default on CUDA: captured at start, that time reported), one with
`enforce_eager`. For each batch size and each of `--rounds` rounds (the engines' order reversed
every other round: the GPU's clocks ramp up in the first seconds of work), `batch` requests with
`--context`-token random prompts are prefilled (not timed), then `--steps` decode steps are timed
one by one (`engine.step()`, which waits for the sampled tokens, so each time is the GPU's work plus
the host's). Each step's time is split three ways: the forward (the model runner's `execute`, then a
device synchronize), the GPU's own time for that forward (CUDA events around it: under a graph the
kernels alone; eagerly it includes the gaps while Python issues launches), and the rest of the step
(scheduling, sampling, bookkeeping on the host). Medians over steps, then over rounds; tokens/s =
batch / step time. One greedy request of each batch is compared token by token between the engines
(graphs must not change the output).

Goals (H200, 1b, bf16): batch-1 decode <= 2.5 ms/step; batch-32 decode >= 10,000 tokens/s.

    python -m benchmarks.decode_graphs [--preset 1b] [--batch 1 32] [--steps 30] [--context 128] [--rounds 3]
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


class ForwardTimer:
    """Wraps an engine's `runner.execute`: wall time to a device synchronize, and the GPU's time
    between CUDA events around it, per call."""

    def __init__(self, engine: Engine) -> None:
        self.runner, self.execute = engine.runner, engine.runner.execute
        self.wall: list[float] = []
        self.gpu: list[float] = []
        self.runner.execute = self

    def __call__(self, plan):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        begin.record()
        out = self.execute(plan)
        end.record()
        torch.cuda.synchronize()
        self.wall.append(time.perf_counter() - start)
        self.gpu.append(begin.elapsed_time(end) / 1e3)
        return out


def decode_times(engine: Engine, batch: int, context: int, steps: int, rng: random.Random
                 ) -> tuple[dict[str, float], list[int]]:
    """Median seconds of a decode step of `batch` sequences (step, forward, GPU), and the first
    request's tokens."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [f"b{batch}-{i}-{rng.random()}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(vocab) for _ in range(context)], params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # prefill: not timed
    assert len(engine.scheduler.running) == batch, "every request must be decoding at once"
    seq = next(s for s in engine.scheduler.running if s.request_id == ids[0])
    engine.step()  # warm-up
    timer, times = ForwardTimer(engine), []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    finally:
        engine.runner.execute = timer.execute
    tokens = list(seq.token_ids[seq.num_prompt_tokens :])
    for request_id in ids:
        engine.abort(request_id)
    return {"step_s": statistics.median(times), "forward_s": statistics.median(timer.wall),
            "gpu_s": statistics.median(timer.gpu)}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
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
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        tokens: dict[str, list[int]] = {}
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                times, tokens[name] = decode_times(engines[name], batch, args.context, args.steps,
                                                   random.Random(batch))
                rounds[name].append(times)
        same = tokens["graphs"] == tokens["eager"]
        for name, per_round in rounds.items():
            median = {key: statistics.median(t[key] for t in per_round) for key in per_round[0]}
            rows.append([name, batch, median["step_s"] * 1e3, median["forward_s"] * 1e3, median["gpu_s"] * 1e3,
                         (median["step_s"] - median["forward_s"]) * 1e3, batch / median["step_s"], starts[name],
                         "yes" if same else "NO"])
            results.append({"mode": name, "batch": batch, **median, "rounds": per_round,
                            "tokens_per_s": batch / median["step_s"], "engine_start_s": starts[name],
                            "tokens_equal": same})
    print(format_table(["mode", "batch", "step ms", "forward ms", "GPU ms", "rest ms", "tokens/s", "engine start s",
                        "same tokens"], rows))
    attention, graphs = engines["graphs"].runner.gpu_decode_attention, engines["graphs"].runner.decode_graphs
    captured = (f"{len(graphs.graphs)} (batch sizes {list(graphs.sizes)} x widths in blocks {list(graphs.widths)})"
                if graphs else "none: capture failed")
    print(f"decode attention: {attention}; graphs: {captured}")
    print(write_results("decode_graphs", {"environment": environment(), "gpu": torch.cuda.get_device_name(),
                                          "preset": args.preset, "decode_attention": attention,
                                          "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
