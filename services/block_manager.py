"""KV block accounting with reference counts and prefix caching (imports no torch).

A block is `block_size` token slots of the paged KV pool. Full, computed blocks are registered
under a hash chained with the previous block's hash, so a later prompt with the same prefix reuses
them. Freed blocks keep their hash and sit in an LRU free list until a new allocation evicts them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept for the equality check on a hash hit


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block given the hash of the block before it (ints hash stably in Python)."""
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the least recently freed comes first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which served from cached blocks
        self._block_hashes: dict[str, list[int]] = {}  # request_id -> hashes of its cached blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so `seq.block_table` covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache -------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Ids of cached blocks holding the longest prefix of full blocks of `token_ids`.

        At least one token is always left uncached, so the prompt's last position is computed and
        yields logits.
        """
        if not self.enable_prefix_caching:
            return []
        num_full = (len(token_ids) - 1) // self.block_size
        hit_ids: list[int] = []
        prev: int | None = None
        for i in range(num_full):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            prev = chain_hash(prev, chunk)
            block_id = self.hash_to_block_id.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hit_ids.append(block_id)
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += len(hit_ids) * self.block_size
        return hit_ids

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        hashes = self._block_hashes.setdefault(seq.request_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(hashes), num_full):
            chunk = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = chain_hash(hashes[-1] if hashes else None, chunk)
            hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids = block_hash, chunk
                self.hash_to_block_id.setdefault(block_hash, block.block_id)

    # -- allocation (query with can_allocate, then commit) -------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Share the cached `block_ids` as the start of an empty `seq.block_table`."""
        assert not seq.block_table
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        # The reused blocks are already registered: record their hashes as this sequence's.
        prev: int | None = None
        hashes = self._block_hashes.setdefault(seq.request_id, [])
        for block_id in block_ids:
            prev = chain_hash(prev, self.blocks[block_id].token_ids)
            hashes.append(prev)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` with fresh blocks to cover `num_tokens` tokens."""
        num_new = self.blocks_needed(seq, num_tokens)
        assert self.can_allocate(num_new), "allocate() without can_allocate()"
        for _ in range(num_new):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached content
                if self.hash_to_block_id.get(block.block_hash) == block_id:
                    del self.hash_to_block_id[block.block_hash]
                block.block_hash, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; cached ones stay reusable until evicted."""
        # Reverse order: a sequence's tail blocks are the least likely to be shared, evict them first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_block_ids[block_id] = None
                    self.free_block_ids.move_to_end(block_id, last=False)  # uncached: reuse first
                else:
                    self.free_block_ids[block_id] = None
        seq.block_table.clear()
        self._block_hashes.pop(seq.request_id, None)
