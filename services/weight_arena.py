"""Host memory for the weights and the KV pool in 2 MB pages, where the kernel allows (Linux transparent
huge pages through madvise). A decode step streams every weight once; with 4 KB pages each 4 KB of a matrix
costs a TLB miss, and on a Zen 4 host that held the native GEMV at 26-31 GB/s against 36-62 GB/s
from 2 MB pages (same run, 65536 x 2048 bf16). torch's allocator does not ask for huge pages, so the
weights are copied, one at a time, into one anonymous mapping that does.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


class HugePageArena:
    """`copy(tensor)` places a copy of a CPU tensor in the arena; a mapping's pages are only backed
    as they are written, so copying tensors one by one and dropping each original keeps the peak
    near one model's size."""

    def __init__(self, num_bytes: int) -> None:
        self._buffer = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._buffer.madvise(mmap.MADV_HUGEPAGE)
        self._raw = torch.frombuffer(self._buffer, dtype=torch.uint8)  # views keep the mapping alive
        self._offset = (-self._raw.data_ptr()) % HUGE_PAGE  # a 2 MB boundary: every page can be huge
        self._end = self._offset + num_bytes

    @staticmethod
    def size_of(tensor: torch.Tensor) -> int:
        return -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        assert self._offset + nbytes <= self._end, "the arena was sized for fewer bytes"
        out = self._raw[self._offset : self._offset + nbytes].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self._offset += self.size_of(tensor)
        return out

    def release(self, tensor: torch.Tensor) -> int:
        """Give back to the system the pages that only `tensor` (a copy in this arena, read by nothing any more) covers;
        the bytes released. Reading them afterwards would find zeros: the caller drops every reference's use first."""
        start = tensor.data_ptr() - self._raw.data_ptr()
        assert 0 <= start and start + tensor.numel() * tensor.element_size() <= self._end, "not in this arena"
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only: a neighbour's bytes stay
        last = (start + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
        if last <= first:
            return 0
        self._buffer.madvise(mmap.MADV_DONTNEED, first, last - first)
        return last - first

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A CPU tensor of zeros in an arena of its own, or None where huge pages cannot be had. Its pages are
        written now, as torch.zeros' are: the memory is taken at start, not by the first steps that write there."""
        nbytes = math.prod(shape) * dtype.itemsize
        arena = cls.create(max(nbytes, 1))
        if arena is None:
            return None
        return arena._raw[arena._offset : arena._offset + nbytes].view(dtype).view(shape).zero_()

    @classmethod
    def create(cls, num_bytes: int) -> HugePageArena | None:
        """None where the platform cannot (no madvise, or no memory for the mapping)."""
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return None
        try:
            return cls(num_bytes)
        except OSError as exc:
            log.warning("%d bytes stay in 4 KB pages (%s)", num_bytes, exc)
            return None
