"""The router's prefix index and the prefill choice it feeds (no Ray: plain worker handles)."""

from __future__ import annotations

from router.prefix_index import PrefixIndex
from router.worker_pool import WorkerHandle, WorkerPool

A = list(range(100, 132))  # two whole blocks of 16
B = list(range(200, 232))


def test_keys_chain_whole_blocks_only():
    index = PrefixIndex(block_size=16)
    assert len(index.keys(A + [1, 2, 3])) == 2 and index.keys(A[:15]) == []
    assert index.keys(A)[0] == index.keys(A[:16] + B[:16])[0]  # same first block
    assert index.keys(A)[1] != index.keys(A[:16] + B[:16])[1]
    assert index.keys(B[:16] + A[16:])[1] != index.keys(A)[1]  # a block's key covers what precedes it


def test_cached_tokens_follow_the_last_worker_sent_each_prefix():
    index = PrefixIndex(block_size=16)
    assert index.cached_tokens(index.keys(A)) == {}
    index.record(index.keys(A + [7]), "prefill-0")
    assert index.cached_tokens(index.keys(A + [9, 9])) == {"prefill-0": 32}
    assert index.cached_tokens(index.keys(A[:16] + B[:16])) == {"prefill-0": 16}
    assert index.cached_tokens(index.keys(B)) == {}
    index.record(index.keys(A[:16]), "prefill-1")  # the first block now lives there too: the chain breaks
    assert index.cached_tokens(index.keys(A)) == {"prefill-1": 16}


def test_capacity_drops_the_least_recently_used_blocks():
    index = PrefixIndex(block_size=16, capacity=2)
    index.record(index.keys(A), "prefill-0")
    index.record(index.keys(B[:16]), "prefill-1")
    assert index.cached_tokens(index.keys(A)) == {}  # A's first block was the oldest
    assert index.cached_tokens(index.keys(B)) == {"prefill-1": 16}


def test_prefill_choice_weighs_queued_tokens_against_cached_ones():
    pool = WorkerPool("test")
    pool.workers = {n: WorkerHandle(n, "prefill", actor=None) for n in ("prefill-0", "prefill-1")}
    pool.workers["prefill-1"].outstanding = 20  # queued there: 20 tokens; cached there: 32 of this prompt
    with pool.claim("prefill", 40, {"prefill-1": 32}) as worker:
        assert worker.name == "prefill-1" and worker.outstanding == 60
    pool.workers["prefill-1"].outstanding = 40  # now the queue costs more than the cache saves
    with pool.claim("prefill", 40, {"prefill-1": 32}) as worker:
        assert worker.name == "prefill-0"
    with pool.claim("prefill", 40) as worker:
        assert worker.name == "prefill-0"
    assert [w.outstanding for w in pool.workers.values()] == [0, 40]


def test_decode_choice_is_load_first_then_the_cached_prefix_then_free_kv():
    """Colocated workers prefill what they decode: of equally loaded ones, the one holding the prompt's
    prefix is chosen even when another has more free KV (a stats poll may have just lowered its count)."""
    pool = WorkerPool("test")
    pool.workers = {n: WorkerHandle(n, "decode", actor=None) for n in ("decode-0", "decode-1")}
    pool.workers["decode-0"].free_kv_blocks, pool.workers["decode-1"].free_kv_blocks = 10, 50
    with pool.claim("decode", 1) as worker:
        assert worker.name == "decode-1"
    with pool.claim("decode", 1, {"decode-0": 32}) as worker:
        assert worker.name == "decode-0" and worker.outstanding == 1
    pool.workers["decode-0"].outstanding = 1  # busier: load comes before the cache
    with pool.claim("decode", 1, {"decode-0": 32}) as worker:
        assert worker.name == "decode-1"
