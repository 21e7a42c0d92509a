"""Where one engine step's time goes: the whole `engine.step()`, the model's forward alone, the time
the host takes just to issue that forward (on a GPU, kernels run asynchronously: when issuing takes
as long as the forward, the step is bound by Python and kernel launches, not by the device), and
torch.profiler's busiest operators.

    python -m benchmarks.step_profile --device cuda --preset 1b --batch 1 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.model_folders import preset_folder
from benchmarks.report import format_table
from services import Engine, SamplingParams
from services.engine_config import QUANTIZATIONS
from services.model_config import ModelConfig
from services.scheduler import ScheduledBatch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, repeats: int, sync: bool = True) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        if sync:
            _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def profile_batch(engine: Engine, batch: int, args) -> list:
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(4, engine.model_config.vocab_size) for _ in range(args.context)], params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    if len(engine.scheduler.running) != batch:
        raise SystemExit(f"batch {batch}: only {len(engine.scheduler.running)} sequences run at once: the KV pool or "
                         "max_num_seqs is too small for the batch asked")
    runner, device = engine.runner, engine.device
    seqs = list(engine.scheduler.running)
    step_ms = _median_ms(engine.step, device, args.repeats)

    def forward() -> torch.Tensor:  # the decode forward of the current state (rewrites the last slot)
        positions = [s.num_tokens - 1 for s in seqs]
        meta = runner._attention_metadata(ScheduledBatch(seqs, [1] * len(seqs)), positions, list(range(len(seqs))))
        with torch.inference_mode():
            return runner.model.forward(runner._tensor([s.token_ids[-1] for s in seqs]), runner._tensor(positions),
                                        meta, runner.kv_slots, runner._tensor(list(range(len(seqs)))))

    forward_ms = _median_ms(forward, device, args.repeats)
    issue_ms = _median_ms(forward, device, args.repeats, sync=False)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            engine.step()
        _sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\nbatch {batch}: top operators of 3 steps by {sort}")
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top))
    print(f"batch {batch}: top operators by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    return [batch, f"{step_ms:.2f}", f"{forward_ms:.2f}", f"{issue_ms:.2f}", f"{step_ms - forward_ms:.2f}"]


def kv_memory_gb(folder, args) -> float:
    """A pool that holds the largest batch's contexts and every step profiled after them (a smaller one ran fewer
    sequences than asked: at 32 x 1,024 tokens of `1b` the old fixed 1 GB held ~25)."""
    c = ModelConfig.from_folder(folder)
    tokens = max(args.batch) * (args.context + 3 * args.repeats + 16)
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * (4 if args.dtype == "float32" else 2)
    return max(1.0, 1.1 * tokens * per_token / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="decoding requests (default 1 32)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request (default 128)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per figure; the median counts")
    parser.add_argument("--top", type=int, default=12, help="operators listed (default 12)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="weights int8 / int4 / w8a8")
    args = parser.parse_args()
    folder = preset_folder(args.preset)
    engine = Engine(model=folder, dtype=args.dtype, device=args.device, num_threads=args.threads,
                    max_num_seqs=max(args.batch), kv_cache_memory_gb=kv_memory_gb(folder, args),
                    max_model_len=args.context + 1024, quantization=args.quantization)
    rows = [profile_batch(engine, b, args) for b in args.batch]
    print(f"\n{args.preset}, {args.dtype} {args.quantization or ''}, device {engine.device}; decode steps, medians of {args.repeats} (ms)")
    print(format_table(["batch", "engine.step", "forward", "issue forward", "step - forward"], rows))


if __name__ == "__main__":
    main()
