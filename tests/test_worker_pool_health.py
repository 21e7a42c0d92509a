"""The router's health tracking (`WorkerPool.poll`): a worker whose actor is dead is out at once; one
that leaves its stats unanswered (a busy host, or hung) is out only after MAX_MISSED_POLLS polls in
a row, and back as soon as it answers."""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError

from router.worker_pool import MAX_MISSED_POLLS, WorkerHandle, WorkerPool
from services.protocol import WorkerStats


class Actor:
    """A worker actor's stats method: answers `report`, never answers (`silent`), or raises `error`."""

    def __init__(self) -> None:
        self.stats = self
        self.silent, self.error = False, None
        self.report = WorkerStats(worker_id="decode-0", role="decode", node_id="n", num_running=0, num_waiting=0,
                                  num_kv_blocks=8, num_free_kv_blocks=5, num_tokens_processed=0,
                                  num_prefix_queries=0, num_prefix_hits=0, num_steps=0)

    def remote(self, reader: str):
        async def answer() -> WorkerStats:
            if self.error is not None:
                raise self.error
            if self.silent:
                await asyncio.Event().wait()  # never set: the poll's timeout ends it, however fast the host
            return self.report
        return answer()


def pool_of(actor: Actor) -> tuple[WorkerPool, WorkerHandle]:
    pool = WorkerPool("pd-test")
    pool.workers = {"decode-0": WorkerHandle("decode-0", "decode", actor)}
    return pool, pool.workers["decode-0"]


def test_a_worker_that_does_not_answer_is_dead_only_after_missed_polls_in_a_row():
    actor = Actor()
    pool, worker = pool_of(actor)
    actor.silent = True
    for missed in range(1, MAX_MISSED_POLLS):
        assert asyncio.run(pool.poll(timeout=0.01)) == []
        assert (worker.alive, worker.missed_polls, [w.name for w in pool.role("decode")]) == (True, missed, ["decode-0"])
    actor.silent = False
    assert [s.num_free_kv_blocks for s in asyncio.run(pool.poll(timeout=5))] == [5]
    assert (worker.alive, worker.missed_polls) == (True, 0)  # an answer starts the count again
    actor.silent = True
    for _ in range(MAX_MISSED_POLLS):
        asyncio.run(pool.poll(timeout=0.01))
    assert (worker.alive, worker.missed_polls, pool.role("decode")) == (False, MAX_MISSED_POLLS, [])
    actor.silent = False
    asyncio.run(pool.poll(timeout=5))
    assert (worker.alive, worker.missed_polls) == (True, 0)


def test_a_dead_actor_is_dead_at_the_first_poll():
    actor = Actor()
    pool, worker = pool_of(actor)
    actor.error = RayActorError()
    assert asyncio.run(pool.poll(timeout=5)) == []
    assert (worker.alive, worker.missed_polls, pool.role("decode")) == (False, 1, [])
