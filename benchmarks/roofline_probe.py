"""The measurements of `pdserve roofline`, on this host, through the engine itself: prefill time
against prompt length, decode and prefill step time against batch size, and the host's ceilings
measured the way the workers measure theirs (`services.hardware_peaks`); the work of each step is
counted with `services.roofline.ModelCost`, the formulas behind the live efficiency gauges.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.cpu_contention import CpuMeter
from services import Engine, SamplingParams


@dataclass(frozen=True)
class Point:
    """One timed step: `size` (prompt length or batch size), its seconds, FLOPs and bytes read."""

    size: int
    seconds: float
    flops: int
    bytes: int
    foreign_cores: float = 0.0  # cores other processes kept busy while it was timed (a noisy host)

    def as_dict(self) -> dict:
        return {"size": self.size, "seconds": self.seconds, "flops": self.flops, "bytes": self.bytes,
                "foreign_cores": self.foreign_cores,
                "flops_per_second": self.flops / self.seconds, "bytes_per_second": self.bytes / self.seconds,
                "arithmetic_intensity": self.flops / self.bytes}


class Probe:
    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine = engine
        self.cost = engine.runner.cost
        self.rng = random.Random(seed)
        self._ids = 0
        self.foreign_cores: list[float] = []

    def _prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(4, self.engine.model_config.vocab_size) for _ in range(length)]

    def _add(self, length: int, max_tokens: int) -> str:
        self._ids += 1
        request_id = f"roofline-{self._ids}"
        self.engine.add_request(request_id, self._prompt(length),
                                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return request_id

    def _timed_step(self) -> float:
        with CpuMeter() as meter:
            start = time.perf_counter()
            self.engine.step()
            seconds = time.perf_counter() - start
        self.foreign_cores.append(meter.foreign_cores)
        return seconds

    def _noise(self) -> float:
        """The median foreign load over the steps timed since the last call."""
        noise = statistics.median(self.foreign_cores) if self.foreign_cores else 0.0
        self.foreign_cores = []
        return noise

    def prefill(self, lengths: list[int], batch: int = 1, repeats: int = 2) -> list[Point]:
        """For each prompt length, the best of `repeats` single steps that prefill `batch` fresh prompts."""
        points = []
        self._add(min(lengths), 1)  # the first forward of a process pays one-time costs: not timed
        while self.engine.has_unfinished_requests:
            self.engine.step()
        for length in lengths:
            best = float("inf")
            for _ in range(repeats):
                for _ in range(batch):
                    self._add(length, 1)
                best = min(best, self._timed_step())
                if self.engine.has_unfinished_requests:
                    raise RuntimeError(f"{batch} prompts of {length} tokens did not fit one step; raise "
                                       "max_num_batched_tokens")
            flops = self.cost.prefill_flops([length] * batch, [length] * batch, batch)
            points.append(Point(length, best, flops,
                                self.cost.weight_bytes + self.engine.runner.kv_bytes_per_token * length * batch,
                                self._noise()))
        return points

    def prefill_batches(self, batches: list[int], length: int, repeats: int = 2) -> list[Point]:
        """Prefill step time against the number of prompts of `length` tokens it takes."""
        return [Point(b, p.seconds, p.flops, p.bytes, p.foreign_cores) for b in batches
                for p in self.prefill([length], batch=b, repeats=repeats)]

    def decode(self, batches: list[int], context: int, steps: int = 5) -> list[Point]:
        """The median of `steps` decode steps of `batch` sequences at ~`context` tokens each."""
        points = []
        for batch in batches:
            ids = [self._add(context, steps + 3) for _ in range(batch)]
            sched = self.engine.scheduler
            while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
                self.engine.step()  # the prompts: not timed
            if len(sched.running) != batch:
                raise RuntimeError(f"only {len(sched.running)} of {batch} sequences decode at once; raise "
                                   "--kv-cache-memory-gb or lower the batch sizes")
            self.engine.step()  # the first decode step after a prefill: not timed
            self._noise()  # the prompts' steps are not part of this point
            samples, work = [], []
            for _ in range(steps):
                contexts = [s.num_tokens for s in sched.running]
                samples.append(self._timed_step())
                work.append((self.cost.prefill_flops([1] * batch, contexts, batch), self.cost.decode_bytes(contexts)))
            for request_id in ids:
                self.engine.abort(request_id)
            points.append(Point(batch, statistics.median(samples), int(np.mean([w[0] for w in work])),
                                int(np.mean([w[1] for w in work])), self._noise()))
        return points


def fit_prefill(points: list[Point]) -> dict:
    """Least squares t(L) = a + b L + c L^2 over the prefill points. `attention_crossover_tokens` =
    b / c, the prompt length where the quadratic (attention) term catches up with the linear one."""
    lengths = np.array([p.size for p in points], dtype=float)
    seconds = np.array([p.seconds for p in points])
    design = np.stack([np.ones_like(lengths), lengths, lengths**2], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    predicted = design @ np.array([a, b, c])
    residual = float(np.sqrt(np.mean((predicted - seconds) ** 2)))
    return {"intercept_s": float(a), "linear_s_per_token": float(b), "quadratic_s_per_token2": float(c),
            "attention_crossover_tokens": float(b / c) if c > 0 else None, "rms_residual_s": residual}


def formula_crossover(cost) -> float:
    """Where the cost formula's attention FLOPs (attention_flops_per_pair * L^2 / 2) equal its
    matmul FLOPs per token times L (2 * layer_matmul_params * L): L = 4 * params / flops_per_pair."""
    return 4 * cost.layer_matmul_params / cost.attention_flops_per_pair
