"""What `pdserve roofline` writes to roofline.json: the probe's points, the prefill fit, the ceilings
and ridge point, and the stall a prompt's arrival causes a running stream in each topology."""

from __future__ import annotations

import argparse
import os

from benchmarks.report import environment
from benchmarks.roofline_probe import Point, Probe, fit_prefill, formula_crossover


def measure(args: argparse.Namespace) -> dict:
    from router.cli import resolve_model
    from services import Engine
    from services.hardware_peaks import HardwarePeaks
    from services.model_config import ModelConfig

    model = resolve_model(args.model)
    limit = ModelConfig.from_folder(model).max_position_embeddings
    max_model_len = max(max(args.lengths), args.chunk_size, args.context + args.steps + 3) + 8
    if max_model_len > limit:
        raise ValueError(f"--lengths / --context need {max_model_len} positions; the model has {limit}")
    batch_tokens = max(max(args.lengths), max(args.batches) * args.prefill_len, max(args.batches) * args.context)
    engine = Engine(model=model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False,
                    max_num_seqs=max(args.batches), max_num_batched_tokens=batch_tokens,
                    max_model_len=max_model_len,
                    kv_cache_memory_gb=args.kv_cache_memory_gb)
    peaks = HardwarePeaks.measure(engine.dtype, engine.device)  # as each worker measures its own
    probe = Probe(engine)
    lengths = sorted(set(args.lengths) | {args.chunk_size})
    prefill = probe.prefill(lengths, repeats=args.repeats)
    decode = probe.decode(args.batches, args.context, args.steps)
    prefill_batches = probe.prefill_batches(args.batches, args.prefill_len, args.repeats)
    ridge = peaks.flops / peaks.bytes_per_second
    cost = engine.runner.cost
    return {
        "model": model, "dtype": str(engine.dtype).removeprefix("torch."),
        "environment": environment() | {"load_average": os.getloadavg()},
        "ceilings": {"flops_per_second": peaks.flops, "bytes_per_second": peaks.bytes_per_second,
                     "ridge_flops_per_byte": ridge, "how": "services.hardware_peaks (as the workers' gauges)"},
        "cost_model": {"layer_matmul_params": cost.layer_matmul_params, "lm_head_params": cost.lm_head_params,
                       "weight_bytes": cost.weight_bytes, "attention_flops_per_pair": cost.attention_flops_per_pair,
                       "kv_bytes_per_token": cost.kv_bytes_per_token},
        "prefill_vs_length": {"points": [p.as_dict() for p in prefill], "fit": fit_prefill(prefill),
                              "formula_crossover_tokens": formula_crossover(cost)},
        "batching": {"context": args.context, "prefill_len": args.prefill_len,
                     "decode": [p.as_dict() for p in decode], "prefill": [p.as_dict() for p in prefill_batches],
                     "decode_compute_bound_batch": _compute_bound_batch(decode, ridge)},
        "disaggregation": stalls(prefill, decode, args.decode_batch, args.chunk_size),
    }


def _compute_bound_batch(decode: list[Point], ridge: float) -> float:
    """The batch at which a decode step's FLOPs per byte reach the ridge point, extrapolated linearly
    from the largest measured batch (intensity grows about linearly with batch while weights dominate)."""
    last = decode[-1]
    intensity = last.flops / last.bytes
    return last.size * ridge / intensity


def stalls(prefill: list[Point], decode: list[Point], decode_batch: int, chunk_size: int) -> dict:
    """What a running stream waits between two tokens while one prompt of each length is prefilled:
    colocated, one step holds the whole prompt (decode step + prefill); with chunked prefill, each of
    ceil(L / chunk) steps holds one chunk (decode step + prefill of a chunk); disaggregated, the stream's
    worker only decodes (the KV hand-off is a copy into its pool, not counted here)."""
    step = next(p.seconds for p in decode if p.size == decode_batch)
    by_len = {p.size: p.seconds for p in prefill}
    chunk = by_len[chunk_size]
    rows = []
    for p in prefill:
        if p.size < chunk_size:
            continue
        colocated = step + p.seconds
        rows.append({"prompt_len": p.size, "colocated_s": colocated, "chunked_s": step + chunk,
                     "chunked_steps": -(-p.size // chunk_size), "disaggregated_s": step,
                     "colocated_over_disaggregated": colocated / step})
    return {"decode_batch": decode_batch, "chunk_size": chunk_size, "decode_step_s": step, "rows": rows}
