"""A worker's own ceilings, measured once at start-up on its cores and in its dtype: matmul FLOP/s
(what bounds prefill) and memory read bandwidth (what bounds decode). The efficiency gauges divide
the achieved rates by these. A short probe (~0.3 s) — `benchmarks/ceilings.py` measures the same
things more carefully; pass known figures (`--peak-tflops`, `--peak-gbps`) to skip it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from services.kernels.linear_candidates import onednn_linear
from services.kernels.native import load
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.kernels.stream_variants import SKINNY_VARIANTS


@dataclass(frozen=True)
class HardwarePeaks:
    flops: float  # matmul FLOP/s in the serving dtype (or float32, where that is faster on a CPU)
    bytes_per_second: float  # memory read bandwidth

    @classmethod
    def measure(cls, dtype: torch.dtype, device: torch.device, matmul_size: int | None = None,
                read_bytes: int = 512 * 2**20) -> HardwarePeaks:
        # A GPU needs a larger product than a CPU core to reach its rate (1024^3 is launch-bound there).
        matmul_size = matmul_size or (8192 if device.type == "cuda" else 1024)
        a = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
        b = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
        matmul = best_seconds(lambda: F.linear(a, b), device, repeats=12)  # bf16 units need a warm-up
        if device.type == "cpu":
            # Without 16-bit matrix instructions the kernel plan multiplies 16-bit weights in float32
            # (float32.linear: AVX2 CPUs, 21 against 142 GFLOP/s), and float32 through oneDNN where MKL's GEMM
            # is slower (Zen 2: 89 against 61), so the ceiling is the fastest of them.
            matmul = min(matmul, best_seconds(partial(fastest_float32_product, a.float(), b.float()), device, 12))
        # A matrix-vector product streams memory faster than a sum on CPU; the buffer is larger than
        # any cache, so it measures DRAM (or HBM) reads.
        columns = 4096
        matrix = torch.ones(read_bytes // 4 // columns, columns, device=device)
        vector = torch.ones(1, columns, device=device)
        read = best_seconds(lambda: F.linear(vector, matrix), device, repeats=3)
        native = load() if device.type == "cpu" else None
        if native is not None:  # where the native kernel streams faster, that is the ceiling
            for variant in SKINNY_VARIANTS.values():
                read = min(read, best_seconds(partial(native.skinny_linear, vector, matrix, None, None, *variant),
                                              device, repeats=3))
        return cls(2 * matmul_size**3 / matmul, matrix.numel() * 4 / read)


def fastest_float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T on a CPU by whichever of torch's float32 products (MKL's `F.linear`, oneDNN's) is faster here:
    the first call for a pair of shapes times both and keeps the winner."""
    key = (tuple(a.shape), tuple(b.shape))
    if key not in _FLOAT32_PRODUCTS:
        found = {"mkl": F.linear}
        if ONEDNN_PACKS.supported(torch.float32):
            found["onednn"] = partial(onednn_linear, bias=None)
        _FLOAT32_PRODUCTS[key] = min(found.values(), key=lambda fn: best_seconds(partial(fn, a, b), a.device, 2))
    return _FLOAT32_PRODUCTS[key](a, b)


_FLOAT32_PRODUCTS: dict[tuple, Callable] = {}


def best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn` (after one untimed), the device synchronised
    around each."""
    with torch.inference_mode():
        fn()
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
    return best
