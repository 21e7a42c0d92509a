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


def test_the_float32_product_is_the_faster_of_mkls_and_onednns(monkeypatch):
    from services.kernels.linear_candidates import onednn_linear
    from services.kernels.onednn_packs import ONEDNN_PACKS

    for onednn_seconds, want in ((0.5, onednn_linear), (2.0, torch.nn.functional.linear)):
        monkeypatch.setattr(hardware_peaks, "_FLOAT32_PRODUCTS", {})
        monkeypatch.setattr(hardware_peaks, "best_seconds",
                            lambda fn, device, repeats, s=onednn_seconds: s if fn.func is onednn_linear else 1.0)
        a, b = torch.randn(3, 5), torch.randn(4, 5)
        torch.testing.assert_close(hardware_peaks.fastest_float32_product(a, b), a @ b.T)
        kept = hardware_peaks._FLOAT32_PRODUCTS[((3, 5), (4, 5))]
        assert (kept.func if hasattr(kept, "func") else kept) is (want if ONEDNN_PACKS.supported(torch.float32)
                                                                   else torch.nn.functional.linear)
