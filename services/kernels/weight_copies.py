"""Copies of weights in a kernel's own layout (int4's and bf16's 16-row panels), one per weight, made on first use in
2 MB pages and freed with the weight or by `drop`.

Legend: a copy is a NamedTuple of tensors (its `_fields` name them); a weight is found by the identity of one of its
tensors (`key_of`: an Int4Weight's packed bytes, a dense weight itself), so a weight object rebuilt around the same
bytes finds the same copy, and `rekey` hands a copy to a weight rebuilt without them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Generic, NamedTuple, TypeVar

import torch

from services.weight_arena import HugePageArena

Copy = TypeVar("Copy", bound=NamedTuple)


class WeightCopies(Generic[Copy]):
    """Per weight: its copy made by `make`; `key_of(weight)` is the tensor a weight is known by (None: a weight of
    another kind, which never has one)."""

    def __init__(self, make: Callable[[object], Copy], key_of: Callable[[object], torch.Tensor | None]) -> None:
        self._make, self._key_of = make, key_of
        self._copies: dict[int, Copy] = {}

    def copy(self, weight: object) -> Copy:
        """`weight`'s copy (made on first use)."""
        key = self._key_of(weight)
        found = self._copies.get(id(key))
        if found is None:
            found = self._copies[id(key)] = _in_huge_pages(self._make(weight))
            weakref.finalize(key, self._copies.pop, id(key), None)
        return found

    def rekey(self, old: object, new: object) -> None:
        """`new` (the same values, rebuilt without `old`'s bytes) takes over `old`'s copy."""
        found = self._copies.pop(id(self._key_of(old)))
        key = self._key_of(new)
        self._copies[id(key)] = found
        weakref.finalize(key, self._copies.pop, id(key), None)

    def keep(self, weights: Iterable[object]) -> int:
        """Make every one of `weights`' copies now (not in the first request); returns their bytes."""
        copies = {id(self._key_of(weight)): self.copy(weight) for weight in weights}
        return sum(t.nbytes for copy in copies.values() for t in copy)

    def held(self, weight: object) -> tuple[torch.Tensor, ...]:
        """The tensors of `weight`'s copy where it has one (the kernel plan flushes them before timing), else ()."""
        key = self._key_of(weight)
        return tuple(self._copies.get(id(key), ())) if key is not None else ()

    def holds(self, weight: object) -> bool:
        key = self._key_of(weight)
        return key is not None and id(key) in self._copies

    def drop(self, weight: object) -> None:
        self._copies.pop(id(self._key_of(weight)), None)


def _in_huge_pages(copy: Copy) -> Copy:
    """`copy` moved into 2 MB pages of its own where the host allows (services/weight_arena.py), made so from the
    start: the weights are in 2 MB pages before the plan times them, and a copy timed in torch's 4 KB pages raced them
    at a disadvantage it would not have in use (int4 panel copies in 4 KB pages: the `1b` int4 step 26.1 against
    24.6 ms, session 38). An arena of its own, so a copy timed and not chosen is freed with it."""
    arena = HugePageArena.create(sum(HugePageArena.size_of(t) for t in copy))
    return copy if arena is None else type(copy)(*(arena.copy(t) for t in copy))
