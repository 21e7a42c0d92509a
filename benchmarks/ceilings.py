"""Hardware ceilings, measured with torch at the configured thread count: memory bandwidth and
matrix throughput.

Bandwidth: a copy between two buffers of `--bytes` each (default 2 GB, well over 4x the 300 MB L3;
read + written bytes counted, write-allocate traffic not) and two reads of one buffer: a float32 sum
reduction, and a matrix-vector product over it viewed as [n, 4096]; best of `--repeats`. The read
ceiling is the better of the two reads. Matrix throughput: `F.linear` (the model's own op) of two square
`--size` matrices in float32 and bfloat16, 2*n^3 FLOPs, best of 2 x `--repeats`. On a shared machine
the best of several is the ceiling; `ReadProbe` / `MatmulProbe` let a benchmark re-measure it next to
each sample of its workload.

    python -m benchmarks.ceilings --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.report import environment, format_table, write_results
from services.hardware_peaks import fastest_float32_product
from services.kernels.stream_variants import SKINNY_VARIANTS


def best_time(fn: Callable[[], object], repeats: int, warmup: int = 1, device: str = "cpu") -> float:
    """Best wall time of `repeats` calls of `fn`, after `warmup` untimed calls (on a GPU, each call's
    kernels are waited for: they run asynchronously)."""
    def call() -> None:
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


class ReadProbe:
    """A float32 buffer of `num_bytes`, read two ways: a sum, and a matrix-vector product over it viewed
    as [n, 4096] (MKL's GEMV streams faster than torch's sum here). `probe(repeats)` is the best read
    bandwidth (bytes/s) of either, best of `repeats` each. Kept alive beside a workload, it re-measures
    the ceiling next to each sample."""

    def __init__(self, num_bytes: int, device: str = "cpu") -> None:
        numel = num_bytes // 4 // 4096 * 4096
        self.device = device
        self.buffer = torch.ones(numel, dtype=torch.float32, device=device)  # filled: every page mapped
        self.num_bytes = numel * 4
        self._matrix = self.buffer.view(-1, 4096)
        self._vector = torch.ones(1, 4096, device=device)

    def sum_rate(self, repeats: int = 2) -> float:
        with torch.inference_mode():
            return self.num_bytes / best_time(self.buffer.sum, repeats, warmup=0, device=self.device)

    def gemv_rate(self, repeats: int = 2) -> float:
        with torch.inference_mode():
            return self.num_bytes / best_time(lambda: F.linear(self._vector, self._matrix), repeats, warmup=0,
                                              device=self.device)

    def native_rate(self, repeats: int = 2) -> float:
        """The native skinny-matmul kernel over the same buffer (0 where it cannot be compiled), read as
        float32 and as bf16, one and four rows in flight (the four prefetched into the caches or past them),
        the best of the six: on some CPUs it streams faster than anything in torch, and then it is the ceiling."""
        from services.kernels.native import load

        native = load() if self.device == "cpu" else None
        if native is None:
            return 0.0
        as_bf16 = self.buffer.view(torch.bfloat16).view(-1, 8192)
        shapes = ((self._matrix, self._vector), (as_bf16, torch.ones(1, 8192, dtype=torch.bfloat16)))
        with torch.inference_mode():
            return max(self.num_bytes / best_time(partial(native.skinny_linear, vector, matrix, None, None, *variant),
                                                  repeats, warmup=0, device=self.device)
                       for matrix, vector in shapes for variant in SKINNY_VARIANTS.values())

    def __call__(self, repeats: int = 2) -> float:
        return max(self.sum_rate(repeats), self.gemv_rate(repeats), self.native_rate(repeats))


class MatmulProbe:
    """Two [size, size] matrices of `dtype`; `probe(repeats)` is the FLOP/s of F.linear on them, best
    of `repeats` (bfloat16 needs ~10 back-to-back calls to reach full speed on this CPU). On a CPU, where
    faster, the float32 product of the same matrices by MKL or oneDNN instead: the kernel plan runs a
    prefill that way where 16-bit products are slow or MKL's GEMM is (services/hardware_peaks.py)."""

    def __init__(self, dtype: torch.dtype, size: int = 4096, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(0)
        self.device = device
        self.a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
        self.b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
        self.flops = 2 * size**3
        self.a32, self.b32 = (self.a.float(), self.b.float()) if device == "cpu" else (None, None)

    def __call__(self, repeats: int = 3) -> float:
        with torch.inference_mode():
            seconds = best_time(lambda: F.linear(self.a, self.b), repeats, warmup=0, device=self.device)
            if self.a32 is not None:
                seconds = min(seconds, best_time(partial(fastest_float32_product, self.a32, self.b32), repeats,
                                                 device=self.device))
            return self.flops / seconds


def memory_bandwidth(num_bytes: int = 2 * 10**9, repeats: int = 5, device: str = "cpu") -> dict[str, float]:
    """GB/s of a large copy (read + write bytes), a large sum, a large GEMV and the native kernel's
    GEMV; `read_gbps` is the best of the reads (the decode ceiling)."""
    probe = ReadProbe(num_bytes, device)
    copy_s = _copy_time(probe.buffer, repeats, device)
    read_sum, read_gemv = probe.sum_rate(repeats) / 1e9, probe.gemv_rate(repeats) / 1e9
    read_native = probe.native_rate(repeats) / 1e9
    return {"copy_gbps": 2 * probe.num_bytes / copy_s / 1e9, "read_sum_gbps": read_sum,
            "read_gemv_gbps": read_gemv, "read_native_gbps": read_native,
            "read_gbps": max(read_sum, read_gemv, read_native), "buffer_bytes": probe.num_bytes}


def _copy_time(src: torch.Tensor, repeats: int, device: str) -> float:
    dst = torch.zeros_like(src)
    with torch.inference_mode():
        return best_time(lambda: dst.copy_(src), repeats, device=device)


def matmul_flops(dtype: torch.dtype, size: int = 4096, repeats: int = 12, device: str = "cpu") -> float:
    """FLOP/s of F.linear on two [size, size] matrices of `dtype` (2 * size^3 FLOPs), best of `repeats`."""
    return MatmulProbe(dtype, size, device)(repeats)


def measure(num_bytes: int = 2 * 10**9, size: int = 4096, repeats: int = 5, device: str = "cpu") -> dict:
    """All ceilings of `device` (on CPU at the current torch thread count; matmuls get 2x `repeats`:
    bf16 warms up slowly)."""
    return {
        **memory_bandwidth(num_bytes, repeats, device),
        "device": device,
        "matmul_size": size,
        "matmul_flops": {"float32": matmul_flops(torch.float32, size, 2 * repeats, device),
                         "bfloat16": matmul_flops(torch.bfloat16, size, 2 * repeats, device)},
    }


def table(ceilings: dict) -> str:
    gb = ceilings["buffer_bytes"] / 1e9
    n = ceilings["matmul_size"]
    return format_table(["ceiling", "value", "unit"], [
        [f"copy bandwidth ({gb:.1f} GB -> {gb:.1f} GB, read+write)", ceilings["copy_gbps"], "GB/s"],
        [f"read bandwidth (float32 sum of {gb:.1f} GB)", ceilings["read_sum_gbps"], "GB/s"],
        [f"read bandwidth (float32 GEMV over {gb:.1f} GB)", ceilings["read_gemv_gbps"], "GB/s"],
        [f"read bandwidth (native GEMV over {gb:.1f} GB)", ceilings["read_native_gbps"], "GB/s"],
        [f"matmul float32 ({n}^3)", ceilings["matmul_flops"]["float32"] / 1e9, "GFLOP/s"],
        [f"matmul bfloat16 ({n}^3)", ceilings["matmul_flops"]["bfloat16"] / 1e9, "GFLOP/s"],
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--bytes", type=float, default=2e9, help="size of each bandwidth buffer in bytes (default 2e9)")
    parser.add_argument("--size", type=int, default=4096, help="square matmul size n (default 4096)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed repetitions (matmuls: twice as many); the best counts (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ceilings = measure(int(args.bytes), args.size, args.repeats, args.device)
    print(f"device={args.device}  threads={torch.get_num_threads()}  torch={torch.__version__}")
    print(table(ceilings))
    path = write_results("ceilings", {"environment": environment(), "ceilings": ceilings})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
