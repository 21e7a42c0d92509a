"""One reused buffer per thread and dtype for the large temporaries of a quantized product: a weight
dequantized to the compute dtype (prefill: many rows, compute-bound, one dense product wins), the
int32 and float32 products of w8a8, so no call allocates them anew.

Why: a dequantized 1b `gate_up` is 64 MB, above glibc's largest mmap threshold (32 MB), so a fresh
tensor per call is a fresh mapping whose pages fault in on first touch: measured on a Zen 4 host,
40 ms to convert a 16384 x 2048 int8 weight into a new tensor, 2-8 ms into a reused one, against
167 ms for the product itself. Sixteen layers of that (~0.8 s) is the gap an int8 prefill showed
behind bf16 in `benchmarks.vs_llama_cpp` (6.49 against 5.67 s for 1,024 tokens).
"""

from __future__ import annotations

import math
import threading

import torch


class DequantBuffer(threading.local):
    """Per thread: the largest buffer asked for so far, per dtype and device."""

    def __init__(self) -> None:
        self.data: dict[tuple[torch.dtype, torch.device, bool], torch.Tensor] = {}

    def holding(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`like` converted to `dtype`, in this thread's buffer: valid until its next use."""
        return self.scratch(like.shape, dtype, like.device).copy_(like)

    def scratch(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `shape` in this thread's buffer for `dtype`: valid until its next use."""
        numel = math.prod(shape)
        # A buffer made under inference mode cannot be written outside it: one buffer for each
        key = (dtype, device, torch.is_inference_mode_enabled())
        data = self.data.get(key)
        if data is None or data.numel() < numel:
            data = self.data[key] = torch.empty(numel, dtype=dtype, device=device)
        return data[:numel].view(shape)

    def release(self) -> None:
        """Drop this thread's buffers (they are made again on next use)."""
        self.data.clear()


DEQUANT_BUFFER = DequantBuffer()
