"""`DeviceKV`: a prompt's KV as a tensor in the producer's (GPU) memory, for Ray Direct Transport,
and `KVStage`, where a prefill worker keeps it until it is taken.

The object-store hand-off (`KVPayload`) checksums host bytes with xxh3. KV that moves GPU to GPU
is checked on the GPU instead, without a copy to the host: a position-weighted sum of its bit
patterns (odd weights, so any single changed element changes the sum modulo 2^64; so do swapped
elements). Shape legend: L layers, T tokens, K kv heads, Dh head dim.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.errors import KVTransferError

_BITS = {2: torch.int16, 4: torch.int32}  # element size -> the integer type of its bit pattern
_CHUNK = 1 << 22  # elements weighed at a time (bounds the temporaries)
_weights: dict[tuple[str, int], torch.Tensor] = {}


def _chunk_weights(device: torch.device, n: int) -> torch.Tensor:
    """w[i] = 2 * (i mod 65521) + 1 (odd) as int32, made once per device and chunk size."""
    key = (str(device), n)
    if key not in _weights:
        _weights[key] = (torch.arange(n, device=device) % 65521 * 2 + 1).to(torch.int32)
    return _weights[key]


def device_checksum(kv: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on kv's device (no host sync): sum over chunks k of (2k + 1) times the sum of
    bits[i] * w[i] (int32 products, wrapping). Every weight is odd, so one changed element always
    changes the sum; elements swapped within or across chunks change it too (unequal weights)."""
    bits = kv.contiguous().view(_BITS[kv.element_size()]).reshape(-1)
    weights = _chunk_weights(kv.device, min(_CHUNK, bits.numel()))
    total = torch.zeros((), dtype=torch.int64, device=kv.device)
    for k, start in enumerate(range(0, bits.numel(), _CHUNK)):
        chunk = bits[start : start + _CHUNK].to(torch.int32)
        total += (chunk * weights[: chunk.numel()]).sum(dtype=torch.int64) * (2 * k + 1)
    return total


@dataclass
class DeviceKV:
    """What an RDT method returns: Ray moves the tensors (kv, checksum) device to device."""

    kv: torch.Tensor  # [L, 2, T, K, Dh], contiguous, on the producer's device
    checksum: torch.Tensor  # 0-d int64, device_checksum(kv) taken by the producer

    @classmethod
    def of(cls, kv: torch.Tensor) -> DeviceKV:
        kv = kv.contiguous()
        return cls(kv, device_checksum(kv))

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def check_layout(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> None:
        """Raise KVTransferError unless it fits the receiving pool (KVPayload's contract: dtype by name)."""
        layers, two, _, heads, dim = self.kv.shape
        own = str(self.kv.dtype).removeprefix("torch.")
        if (layers, two, heads, dim, own) != (num_layers, 2, num_kv_heads, head_dim, dtype):
            raise KVTransferError(f"KV of shape {tuple(self.kv.shape)} {own} does not fit a pool of "
                                  f"{num_layers} layers, {num_kv_heads} kv heads of {head_dim}, {dtype}")

    def verify(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> None:
        """Raise KVTransferError unless the layout fits and the checksum holds."""
        self.check_layout(num_layers, num_kv_heads, head_dim, dtype)
        got, sent = int(device_checksum(self.kv)), int(self.checksum)
        if got != sent:
            raise KVTransferError(f"KV checksum mismatch: sent {sent:#x}, received {got:#x}")

    def copy_into(self, kv_slots: torch.Tensor, slots: torch.Tensor) -> None:
        """Write it into the pool [L, 2, S, K, Dh] at `slots` [T] (one copy, on the pool's device)."""
        kv_slots.index_copy_(2, slots, self.kv.to(kv_slots.device, non_blocking=True))


class KVStage:
    """A prefill worker's exported KV, by request id, until the router takes it (then only the RDT
    object holds it) or `lease_s` passes (the router that would take it died)."""

    def __init__(self, lease_s: float = 30.0, clock=time.monotonic) -> None:
        self.lease_s, self.clock = lease_s, clock
        self._staged: dict[str, tuple[float, DeviceKV]] = {}

    def put(self, request_id: str, kv: DeviceKV) -> None:
        self.expire()
        self._staged[request_id] = (self.clock() + self.lease_s, kv)

    def take(self, request_id: str) -> DeviceKV:
        """The KV of `request_id`, removed from the stage; KVTransferError if gone or never staged."""
        entry = self._staged.pop(request_id, None)
        if entry is None:
            raise KVTransferError(f"no staged KV for request {request_id!r} (expired, taken, or never exported)")
        return entry[1]

    def expire(self) -> list[str]:
        """Drop what outlived its lease; the request ids dropped."""
        now = self.clock()
        gone = [rid for rid, (deadline, _) in self._staged.items() if deadline <= now]
        for rid in gone:
            del self._staged[rid]
        return gone

    def __len__(self) -> int:
        return len(self._staged)
