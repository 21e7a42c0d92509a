"""The engines `benchmarks/tensor_parallel.py` measures: each pinned to its cores, with timers
around its steps, its group's collectives and its KV moves; and an all-reduce timed on its own."""

from __future__ import annotations

import os
import statistics
import time

from services import Engine, SamplingParams
from services.scheduler import SampledToken


def timed(owner: object, name: str, into: list[float]) -> None:
    """Wrap `owner.name` so each call's seconds are appended to `into`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


class Probe:
    """One engine under test, its ranks pinned, with timers around its steps, collectives and KV moves."""

    def __init__(self, model: str, size: int, threads: int, cores: list[int]) -> None:
        os.sched_setaffinity(0, set(cores))
        self.engine = Engine(model, dtype="float32", num_threads=threads, tensor_parallel_size=size,
                             enable_prefix_caching=False, max_model_len=2048)
        # Rank 0 (or the single engine) runs in this process, which several probes share: each sets
        # its cores and threads before it runs (`activate`); the other ranks stay pinned.
        self.threads, self.cores = threads, set(cores) if size == 1 else {cores[0]}
        if size > 1:
            for rank, process in enumerate(self.engine.tensor_parallel.processes, start=1):
                os.sched_setaffinity(process.pid, {cores[rank]})
        self.steps: list[float] = []
        self.collectives: list[float] = []
        self.broadcasts: list[float] = []  # the step plan's broadcast alone (also in collectives)
        self.exports: list[float] = []
        self.imports: list[float] = []
        timed(self.engine, "step", self.steps)
        timed(self.engine.runner, "_export", self.exports)
        timed(self.engine.runner, "_import", self.imports)
        if size > 1:
            group = self.engine.tensor_parallel.group
            timed(group, "broadcast", self.broadcasts)
            for name in ("all_reduce", "gather_rows", "broadcast", "send", "recv"):
                timed(group, name, self.collectives)
        self.count = 0

    def activate(self) -> None:
        import torch

        os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(self.threads)

    def _run(self, requests: list[list[int]], params: SamplingParams) -> tuple[float, float]:
        """Run to completion; (step seconds, collective seconds) of those steps."""
        del self.steps[:], self.collectives[:]
        self.engine.generate(requests, params)
        return sum(self.steps), sum(self.collectives)

    def prefill(self, tokens: int) -> tuple[float, float]:
        """Seconds of one `tokens`-token prefill, and the collectives' share of it."""
        self.activate()
        prompt = [1] + [5 + i % 30000 for i in range(tokens - 1)]
        seconds, collectives = self._run([prompt], SamplingParams(max_tokens=1, temperature=0))
        return seconds, collectives / seconds

    def decode(self, batch: int, steps: int) -> tuple[float, float, float]:
        """Median seconds of a decode step of `batch` sequences, the collectives' share, and the
        median seconds of its plan's broadcast."""
        self.activate()
        prompts = [[1] + [7 + 13 * b + i for i in range(31)] for b in range(batch)]
        del self.steps[:], self.collectives[:]
        collected: list[tuple[float, float]] = []
        inner = self.engine.step

        def one_step():
            before_c, before_b = sum(self.collectives), sum(self.broadcasts)
            start = time.perf_counter()
            out = inner()
            collected.append((time.perf_counter() - start, sum(self.collectives) - before_c,
                              sum(self.broadcasts) - before_b))
            return out

        self.engine.step = one_step
        try:
            self.engine.generate(prompts, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
        finally:
            self.engine.step = inner
        decode_steps = collected[1:]  # the first step prefills
        return (statistics.median(s for s, _, _ in decode_steps),
                statistics.median(c / s for s, c, _ in decode_steps),
                statistics.median(b for _, _, b in decode_steps))

    def export(self, tokens: int, trials: int):
        """(median export seconds, the last payload) of a `tokens`-token prompt's KV."""
        self.activate()
        prompt = [1] + [9 + i % 30000 for i in range(tokens - 1)]
        del self.exports[:]
        payload = None
        for _ in range(trials):
            self.count += 1
            self.engine.add_request(f"e{self.count}", prompt, SamplingParams(max_tokens=1, temperature=0),
                                    export_kv=True)
            while self.engine.has_unfinished_requests:
                for out in self.engine.step():
                    payload = out.kv or payload
        return statistics.median(self.exports), payload, prompt

    def import_kv(self, payload, prompt: list[int], trials: int) -> tuple[float, float]:
        """(median import seconds, median checksum seconds) of `payload` into this engine's pool."""
        self.activate()
        del self.imports[:]
        checks = []
        for _ in range(trials):
            self.count += 1
            start = time.perf_counter()
            self.engine.verify_kv(payload)
            checks.append(time.perf_counter() - start)
            self.engine.add_prefilled(f"i{self.count}", prompt, SampledToken(5), SamplingParams(max_tokens=2),
                                      payload, kv_check=_done())
            while self.engine.has_unfinished_requests:
                self.engine.step()
        return statistics.median(self.imports), statistics.median(checks)

    def close(self) -> None:
        self.engine.close()


def _done():
    from concurrent.futures import Future

    future = Future()
    future.set_result(None)
    return future


def _all_reduce_loop(rank: int, address: str, core: int, shapes: list[tuple[int, int]], repeats: int, results) -> None:
    """One of two spawned ranks: the median seconds of an all-reduce of each shape (float32)."""
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2)
    medians = []
    for shape in shapes:
        x, times = torch.randn(shape), []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    if rank == 0:
        results.put(medians)
    dist.destroy_process_group()


def all_reduce_alone(cores: list[int], shapes: list[tuple[int, int]], repeats: int = 50) -> list[float]:
    """An all-reduce's own cost between two ranks on their own cores, outside any step (so without the
    waiting for a late rank that the in-step timing includes)."""
    import multiprocessing

    from services.tensor_parallel import free_address

    context = multiprocessing.get_context("spawn")
    results, address = context.Queue(), free_address()
    ranks = [context.Process(target=_all_reduce_loop, args=(r, address, cores[r], shapes, repeats, results))
             for r in range(2)]
    for process in ranks:
        process.start()
    medians = results.get(timeout=300)
    for process in ranks:
        process.join(timeout=30)
    return medians
