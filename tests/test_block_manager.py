"""BlockManager: exact block ids for allocation, sharing, prefix hits, eviction order."""

from __future__ import annotations

from services.block_manager import BlockManager
from services.sampling_params import SamplingParams
from services.sequence import Sequence


def seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, list(token_ids), len(token_ids), SamplingParams(), 0, 0)


def computed(bm: BlockManager, s: Sequence) -> None:
    """Pretend the whole sequence was run, and register its full blocks."""
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_takes_lowest_free_ids_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq("a", range(10))
    assert bm.blocks_needed(a, 10) == 3
    bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.allocate(a, 12)  # still fits in three blocks
    assert a.block_table == [0, 1, 2]
    bm.allocate(a, 13)
    assert a.block_table == [0, 1, 2, 3]
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 8
    b = seq("b", range(3))
    bm.allocate(b, 3)
    assert b.block_table == [0]  # freed uncached blocks go to the front of the free list


def test_prefix_hit_shares_full_blocks_and_checks_token_equality():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", range(10))
    bm.allocate(a, 10)
    computed(bm, a)  # blocks 0 and 1 are full: registered; block 2 holds 2 tokens: not
    b = seq("b", list(range(8)) + [99, 98, 97])
    hit = bm.find_cached_prefix(b.token_ids)
    assert hit == [0, 1]
    bm.allocate_prefix(b, hit)
    bm.allocate(b, b.num_tokens)
    assert b.block_table == [0, 1, 3]
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2
    assert bm.num_prefix_hits == 8 and bm.num_prefix_queries == 11
    c = seq("c", [0, 1, 2, 5, 4, 5, 6, 7, 8])  # differs inside the first block: no hit at all
    assert bm.find_cached_prefix(c.token_ids) == []


def test_whole_prompt_cached_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", range(8))
    bm.allocate(a, 8)
    computed(bm, a)
    # The same 8-token prompt: both blocks are cached, but the last block is not used so the
    # prompt's final position is computed and gives logits.
    assert bm.find_cached_prefix(list(range(8))) == [0]
    assert bm.find_cached_prefix(list(range(9))) == [0, 1]


def test_freed_cached_blocks_are_revived_or_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    computed(bm, a)
    bm.free(a)  # blocks 0, 1 cached; block 2 (partial) uncached
    assert list(bm.free_block_ids) == [2, 3, 1, 0]
    b = seq("b", [1, 2, 3, 4, 9])
    hit = bm.find_cached_prefix(b.token_ids)
    assert hit == [0, 1]
    bm.allocate_prefix(b, hit)
    assert bm.blocks[0].ref_count == 1 and list(bm.free_block_ids) == [2, 3]
    bm.free(b)
    # Now allocate enough fresh blocks to evict the cached ones: the tail block (1) goes before 0.
    c = seq("c", [7] * 6)
    bm.allocate(c, 6)
    assert c.block_table == [2, 3, 1]
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]) == [0]
    assert bm.blocks[1].block_hash is None
