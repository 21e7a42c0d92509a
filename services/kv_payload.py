"""The KV hand-off format: one contiguous array per sequence, its dtype and a checksum (no torch)."""

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
class KVPayload:
    """One sequence's KV cache in the hand-off format.

    data: [num_layers, 2, num_tokens, num_kv_heads, head_dim], contiguous, in `WIRE_DTYPES[dtype]`.
    The checksum is computed by the sender and verified by the receiver before any block is written.
    """

    data: np.ndarray
    dtype: str
    checksum: int

    @classmethod
    def from_array(cls, data: np.ndarray, dtype: str) -> KVPayload:
        if dtype not in WIRE_DTYPES or data.dtype != WIRE_DTYPES[dtype]:
            raise KVTransferError(f"KV array of numpy dtype {data.dtype} does not carry {dtype}")
        data = np.ascontiguousarray(data)
        return cls(data=data, dtype=dtype, checksum=kv_checksum(data))

    @property
    def num_tokens(self) -> int:
        return self.data.shape[2]

    @property
    def num_bytes(self) -> int:
        return self.data.nbytes

    def verify(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> None:
        """Raise KVTransferError unless shape, dtype and checksum match what the receiver expects."""
        expected = (num_layers, 2, self.num_tokens, num_kv_heads, head_dim)
        if self.data.ndim != 5 or self.data.shape != expected:
            raise KVTransferError(f"KV shape {self.data.shape} does not match the model, expected {expected}")
        if self.dtype != dtype or self.data.dtype != WIRE_DTYPES[dtype]:
            raise KVTransferError(f"KV dtype {self.dtype} ({self.data.dtype}) does not match the pool's {dtype}")
        actual = kv_checksum(self.data)
        if actual != self.checksum:
            raise KVTransferError(f"KV checksum mismatch: sent {self.checksum:#018x}, received {actual:#018x}")
