"""Which prefill worker last computed each prompt prefix, so a prompt goes where its prefix is cached.

The router keys whole blocks of prompt tokens by chained hashes (a block's key covers every token
before it, as the workers' prefix caches do) and remembers, per key, the worker it last sent that
block to. It is the router's own guess: a worker may have evicted the blocks since, and then the
prompt is just computed in full there, as it would have been anywhere.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, block_size: int, capacity: int = 262_144) -> None:
        self.block_size = block_size
        self.capacity = capacity  # block keys remembered (~100 B each), least recently used dropped first
        self._owner: OrderedDict[int, str] = OrderedDict()

    def keys(self, token_ids: list[int]) -> list[int]:
        """One chained key per whole block of `token_ids`."""
        keys, key = [], 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            key = hash((key, tuple(token_ids[start : start + self.block_size])))
            keys.append(key)
        return keys

    def cached_tokens(self, keys: list[int]) -> dict[str, int]:
        """Tokens of the prompt's longest indexed prefix, by the worker that holds it (at most one)."""
        owner = self._owner.get(keys[0]) if keys else None
        if owner is None:
            return {}
        blocks = 0
        for key in keys:
            if self._owner.get(key) != owner:
                break
            blocks += 1
        return {owner: blocks * self.block_size}

    def record(self, keys: list[int], worker: str) -> None:
        """`worker` now holds these blocks."""
        for key in keys:
            self._owner[key] = worker
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
