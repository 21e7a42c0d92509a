"""Conditional disaggregation's choice (router/prefill_placement.py) and the rates the pool measures
for it, with stand-in workers (the end-to-end check is in test_e2e_disaggregated.py)."""

from __future__ import annotations

import asyncio

import pytest

from router.prefill_placement import PrefillPlacement
from router.worker_pool import WorkerHandle, WorkerPool
from services.protocol import WorkerStats

KV_PER_TOKEN = 24576  # bytes (the small preset)


def measured(hop_s: float = 0.003) -> PrefillPlacement:
    """The cost model after one remote prefill: hop 3 ms, 24 KiB of KV per token."""
    placement = PrefillPlacement(None)
    placement.observe_prefill(0.010 + hop_s, 0.010, 100 * KV_PER_TOKEN, 100)
    return placement


def workers(queued: int = 0, streams: int = 0, decode_flops: float = 1e12) -> tuple[WorkerHandle, WorkerHandle]:
    prefill = WorkerHandle("prefill-0", "prefill", None, outstanding=queued, prefill_tokens_per_second=10_000,
                           peak_flops=1e12)
    return prefill, WorkerHandle("decode-0", "decode", None, outstanding=streams, peak_flops=decode_flops)


def test_the_static_rule_is_a_token_threshold():
    assert [PrefillPlacement(8).local(n, None, 0, None, None) for n in (1, 8, 9)] == [True, True, False]
    assert not PrefillPlacement(0).local(1, *workers()[:1], 0, workers()[1], 1e9)


def test_nothing_measured_yet_means_the_prefill_pool():
    prefill, decode = workers()
    assert not PrefillPlacement(None).local(100, prefill, 0, decode, 1e9)  # no hop, no KV size yet
    assert not measured().local(100, prefill, 0, decode, None)  # no KV transfer measured yet
    assert not measured().local(100, WorkerHandle("prefill-0", "prefill", None), 0, decode, 1e9)  # no rate
    assert not measured().local(100, None, 0, decode, 1e9) and not measured().local(100, prefill, 0, None, 1e9)


@pytest.mark.parametrize(("queued", "streams", "prompt", "cached", "local"), [
    # local = (1 + streams) x prompt / 10k tok/s; remote = (queued + prompt - cached) / 10k + 3 ms + prompt x 24.6 us
    (0, 0, 100, 0, True),  # 10 ms here vs 15.5 ms there: an idle decode worker saves the hop and hand-off
    (0, 4, 100, 0, False),  # 50 ms of stalls for 4 streams vs 15.5 ms
    (5000, 4, 100, 0, True),  # ...unless the prefill worker has 0.5 s of prompts queued
    (0, 0, 1000, 0, True),  # 100 ms vs 127.6 ms
    (0, 0, 1000, 992, False),  # ...but the prefill worker has 992 of its tokens cached: 28.4 ms
])
def test_the_cost_model_weighs_stalled_streams_against_the_hop(queued, streams, prompt, cached, local):
    prefill, decode = workers(queued, streams)
    assert measured().local(prompt, prefill, cached, decode, 1e9) is local


def test_other_routers_work_counts_through_what_the_workers_report():
    prefill, decode = workers()
    decode.reported_requests = 4  # streams other routers sent there: 50 ms of stalls vs 15.5 ms remote
    assert not measured().local(100, prefill, 0, decode, 1e9)
    prefill, decode = workers(streams=4)
    prefill.reported_queued_tokens = 5000  # other routers' queue at the prefill worker: 0.5 s
    assert measured().local(100, prefill, 0, decode, 1e9)
    assert measured().first_token_seconds(100, prefill) == pytest.approx(5100 / 10_000 + 0.003)


def test_discovery_replaces_a_worker_whose_name_now_belongs_to_a_new_actor(monkeypatch):
    class Handle:
        def __init__(self, actor_id: str) -> None:
            self._actor_id = actor_id

    pool = WorkerPool("pd-test")
    pool.workers = {"decode-0": WorkerHandle("decode-0", "decode", Handle("a")),
                    "decode-1": WorkerHandle("decode-1", "decode", Handle("b"), alive=False),
                    "prefill-0": WorkerHandle("prefill-0", "prefill", Handle("c"))}
    found = {"decode-0": Handle("a"), "decode-1": Handle("new"), "prefill-1": Handle("d")}  # prefill-0 removed
    monkeypatch.setattr("router.worker_pool.named_workers", lambda namespace, known: found)
    assert pool.discover() == ["decode-1", "prefill-0"]
    assert {name: w.actor._actor_id for name, w in pool.workers.items()} == {"decode-0": "a", "decode-1": "new",
                                                                              "prefill-1": "d"}
    assert pool.workers["decode-1"].alive and pool.workers["prefill-1"].role == "prefill"


def test_a_decode_worker_with_less_compute_prefills_slower():
    prefill, decode = workers(decode_flops=0.5e12)  # local: 20 ms for 100 tokens vs 15.5 ms remote
    assert not measured().local(100, prefill, 0, decode, 1e9)
    assert measured().local(100, *workers()[:1], 0, workers()[1], 1e9)


def test_time_to_first_token_needs_both_measurements():
    prefill, _ = workers(queued=5000)
    assert measured().first_token_seconds(100, prefill) == pytest.approx(5100 / 10_000 + 0.003)
    assert PrefillPlacement(None).first_token_seconds(100, prefill) is None  # no hop measured
    assert measured().first_token_seconds(100, WorkerHandle("prefill-0", "prefill", None)) is None  # no rate
    assert measured().first_token_seconds(100, None) is None


def test_the_hop_is_a_running_average_of_what_the_worker_did_not_spend():
    placement = PrefillPlacement(None)
    placement.observe_prefill(0.015, 0.010, 4096, 16)
    assert placement.hop_seconds == pytest.approx(0.005) and placement.kv_bytes_per_token == 256
    placement.observe_prefill(0.020, 0.005, 4096, 16)
    assert placement.hop_seconds == pytest.approx(0.8 * 0.005 + 0.2 * 0.015)
    placement.observe_prefill(0.001, 0.002, 4096, 16)  # clocks of two processes: never negative
    assert placement.hop_seconds == pytest.approx(0.8 * (0.8 * 0.005 + 0.2 * 0.015))
    placement.observe_prefill(0.015, 0.010, 0, 16)  # a one-token request's prefill: no KV, its size unknown
    assert placement.kv_bytes_per_token == 256


def test_the_pool_measures_prefill_rates_and_kv_transfers():
    def stats(role: str, **fields) -> WorkerStats:
        base = dict(worker_id=f"{role}-0", role=role, node_id="n", num_running=0, num_waiting=0, num_kv_blocks=8,
                    num_free_kv_blocks=8, num_tokens_processed=0, num_prefix_queries=0, num_prefix_hits=0,
                    num_steps=0, peak_flops=2e12)
        return WorkerStats(**{**base, **fields})

    class Actor:
        def __init__(self, report: WorkerStats) -> None:
            self.stats = self
            self.report = report

        def remote(self, reader: str):
            async def answer() -> WorkerStats:
                return self.report
            return answer()

    pool = WorkerPool("pd-test")
    pool.workers = {
        "prefill-0": WorkerHandle("prefill-0", "prefill",
                                  Actor(stats("prefill", num_tokens_processed=3000, prefill_seconds=0.5))),
        "decode-0": WorkerHandle("decode-0", "decode", Actor(stats("decode", num_tokens_processed=900,
                                                                   prefill_seconds=0.1,
                                                                   kv_transfers=((0.001, 1_000_000), (0.002, 1_000_000))))),
    }
    asyncio.run(pool.poll())
    prefill, decode = pool.workers["prefill-0"], pool.workers["decode-0"]
    assert (prefill.prefill_tokens_per_second, prefill.peak_flops) == (6000, 2e12)
    assert decode.prefill_tokens_per_second == 0  # a decode worker's tokens are mostly decode steps
    assert pool.kv_bytes_per_second == pytest.approx(0.8 * 1e9 + 0.2 * 0.5e9)
    # The next window: 1,000 more tokens in 0.5 s (0.4 s of it in one-token, "decode", steps). The
    # rate is the ratio of the decaying sums of work: (0.8 x 3000 + 1000) / (0.8 x 0.5 + 0.5).
    pool.workers["prefill-0"].actor.report = stats("prefill", num_tokens_processed=4000, prefill_seconds=0.6,
                                                   decode_seconds=0.4)
    asyncio.run(pool.poll())
    assert prefill.prefill_tokens_per_second == pytest.approx(3400 / 0.9)
    asyncio.run(pool.poll())  # a window with no work leaves the ratio as it was
    assert prefill.prefill_tokens_per_second == pytest.approx(3400 / 0.9)
    pool.workers["prefill-0"].actor.report = stats("prefill", num_tokens_processed=10, prefill_seconds=0.05)
    asyncio.run(pool.poll())  # restarted (counts from zero), one tiny prompt: weighs what it did
    assert prefill.prefill_tokens_per_second == pytest.approx((0.64 * 3400 + 10) / (0.64 * 0.9 + 0.05))
