"""A worker's ceilings: the matmul peak of a 16-bit model on a CPU is the faster of its dtype's product and
float32's (the kernel plan runs 16-bit weights in float32 where that is faster), timed with a fake clock."""

from __future__ import annotations

import torch

from services import hardware_peaks
from services.hardware_peaks import HardwarePeaks


def test_the_matmul_peak_is_the_faster_of_the_dtype_and_float32(monkeypatch):
    seconds = {torch.bfloat16: 1.0, torch.float32: 0.25}  # a CPU without 16-bit matrix instructions

    def fake_best_seconds(fn, device, repeats):
        with torch.inference_mode():
            out = fn()
        return seconds[out.dtype] if out.shape[0] == out.shape[1] else 0.5  # square: a matmul; else a read
    monkeypatch.setattr(hardware_peaks, "best_seconds", fake_best_seconds)
    size = 64
    peaks = HardwarePeaks.measure(torch.bfloat16, torch.device("cpu"), matmul_size=size, read_bytes=4 * 4096 * 8)
    assert peaks.flops == 2 * size**3 / 0.25
    seconds[torch.float32] = 4.0  # a CPU whose 16-bit product is the faster one
    assert HardwarePeaks.measure(torch.bfloat16, torch.device("cpu"), matmul_size=size,
                                 read_bytes=4 * 4096 * 8).flops == 2 * size**3 / 1.0
    # a float32 model measures float32 alone
    assert HardwarePeaks.measure(torch.float32, torch.device("cpu"), matmul_size=size,
                                 read_bytes=4 * 4096 * 8).flops == 2 * size**3 / 4.0
