"""The KV hand-off format: one sequence's KV as slices of consecutive kv heads, each contiguous and
checksummed, plus the dtype (no torch).

A single engine hands off one slice holding every head. A tensor-parallel prefill group hands off
one slice per distinct head range its ranks hold, so no rank's KV is copied into a larger array on
the way; the receiver re-slices by heads for its own layout (`heads`), whatever its group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from services.errors import KVTransferError

# numpy has no bfloat16: bf16 KV travels as its raw 16-bit pattern in an int16 array.
WIRE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}


def kv_checksum(data: np.ndarray) -> int:
    """XXH3-64 of the array's bytes, read in place. Measured here (benchmarks/kv_transfer.py) it
    runs at 3-8x zlib's CRC-32, which made the checksum most of a same-node hand-off."""
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(data)).cast("B"))


@dataclass(frozen=True)
class KVSlice:
    """Kv heads [head_start, head_start + data.shape[3]) of one sequence.

    data: [num_layers, 2, num_tokens, num_slice_heads, head_dim], contiguous, in the wire dtype;
    checksum: the sender's, of these bytes alone (each slice is verified on its own)."""

    data: np.ndarray
    checksum: int
    head_start: int = 0

    @classmethod
    def of(cls, data: np.ndarray, head_start: int = 0) -> KVSlice:
        data = np.ascontiguousarray(data)
        return cls(data=data, checksum=kv_checksum(data), head_start=head_start)

    @property
    def num_heads(self) -> int:
        return self.data.shape[3]


@dataclass(frozen=True)
class KVPayload:
    """One sequence's KV cache in the hand-off format: `slices` in head order, covering every kv
    head once. The receiver verifies shape, dtype and every slice's checksum before using any."""

    slices: tuple[KVSlice, ...]
    dtype: str

    @classmethod
    def from_array(cls, data: np.ndarray, dtype: str, head_start: int = 0) -> KVPayload:
        """One slice (a whole single-engine KV, or the heads from `head_start` on)."""
        return cls.from_slices([(head_start, data)], dtype)

    @classmethod
    def from_slices(cls, parts: list[tuple[int, np.ndarray]], dtype: str) -> KVPayload:
        """Slices from (first head, array) pairs, each checksummed."""
        for _, data in parts:
            if dtype not in WIRE_DTYPES or data.dtype != WIRE_DTYPES[dtype]:
                raise KVTransferError(f"KV array of numpy dtype {data.dtype} does not carry {dtype}")
        ordered = sorted(parts, key=lambda part: part[0])
        return cls(slices=tuple(KVSlice.of(data, start) for start, data in ordered), dtype=dtype)

    @property
    def num_tokens(self) -> int:
        return self.slices[0].data.shape[2]

    @property
    def num_heads(self) -> int:
        return sum(s.num_heads for s in self.slices)

    @property
    def num_bytes(self) -> int:
        return sum(s.data.nbytes for s in self.slices)

    @property
    def data(self) -> np.ndarray:
        """The whole KV [L, 2, T, K, Dh]: the one slice itself, or (several slices) a copy joined by heads."""
        if len(self.slices) == 1:
            return self.slices[0].data
        return np.concatenate([s.data for s in self.slices], axis=3)

    @property
    def checksum(self) -> int:
        """The one slice's checksum (a single-slice payload's, as it was before slices)."""
        if len(self.slices) != 1:
            raise ValueError(f"a payload of {len(self.slices)} slices has one checksum per slice")
        return self.slices[0].checksum

    def heads(self, start: int, count: int) -> list[tuple[int, np.ndarray]]:
        """Kv heads [start, start + count) as (offset in that range, view [L, 2, T, n, Dh]) pieces, read
        in place from the slices that hold them (a receiver of another tensor-parallel size re-slices)."""
        pieces = []
        for s in self.slices:
            lo, hi = max(start, s.head_start), min(start + count, s.head_start + s.num_heads)
            if lo < hi:
                pieces.append((lo - start, s.data[:, :, :, lo - s.head_start : hi - s.head_start]))
        if sum(p.shape[3] for _, p in pieces) != count:
            raise KVTransferError(f"KV heads [{start}, {start + count}) are not all in the payload's slices "
                                  f"{[(s.head_start, s.num_heads) for s in self.slices]}")
        return pieces

    def verify(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> None:
        """Raise KVTransferError unless the layout fits (`check_layout`) and every slice's checksum holds."""
        self.check_layout(num_layers, num_kv_heads, head_dim, dtype)
        for s in self.slices:
            actual = kv_checksum(s.data)
            if actual != s.checksum:
                raise KVTransferError(f"KV checksum mismatch in heads from {s.head_start}: sent "
                                      f"{s.checksum:#018x}, received {actual:#018x}")

    def check_layout(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> None:
        """Raise KVTransferError unless the slices cover the heads in order and shapes and dtype match
        (no pass over the bytes: cheap enough to run before the copy that the checksum runs beside)."""
        if self.dtype != dtype:
            raise KVTransferError(f"KV dtype {self.dtype} does not match the pool's {dtype}")
        next_head = 0
        for s in self.slices:
            expected = (num_layers, 2, self.num_tokens, s.num_heads if s.data.ndim == 5 else None, head_dim)
            if s.data.ndim != 5 or s.data.shape != expected or s.head_start != next_head:
                whole = (num_layers, 2, self.num_tokens, num_kv_heads, head_dim)
                raise KVTransferError(f"KV shape {s.data.shape} (heads from {s.head_start}) does not match the "
                                      f"model, expected slices of {whole} in head order")
            if s.data.dtype != WIRE_DTYPES[dtype]:
                raise KVTransferError(f"KV dtype {self.dtype} ({s.data.dtype}) does not match the pool's {dtype}")
            next_head += s.num_heads
        if next_head != num_kv_heads:
            raise KVTransferError(f"KV shape covers {next_head} kv heads, expected {num_kv_heads} "
                                  f"({(num_layers, 2, self.num_tokens, num_kv_heads, head_dim)})")
