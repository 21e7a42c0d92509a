"""Disaggregated serving with the KV over Ray Direct Transport, end to end on CPU workers: NIXL
(through UCX) moves each prompt's `DeviceKV` from the prefill worker, which put it, to the decode
worker, the router passing the ref on inside the prefill stream's second item. On a simulated
two-node Ray cluster, beside an object-store deployment of the same model on the same cluster:
the same tokens, the KV checked on arrival, a corrupt or lost KV recomputed, nothing left behind."""

from __future__ import annotations

import asyncio
import importlib.util

import e2e_checks as checks
import pytest
import ray
from cluster_harness import (
    crash_and_restart,
    process_id,
    router_server,
    two_node_cluster,
    wait_for,
    wait_restarted,
)

from router.decode_channel import WorkerFailed
from router.errors import APIError
from router.launcher import ClusterSpec
from router.orchestrator import Orchestrator
from router.worker_pool import WorkerPool
from services import Engine
from services.protocol import DecodeRequest, PrefillRequest
from services.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                reason="NIXL not installed (pip install --no-deps nixl nixl-cu12: runs on CPU through UCX)")

OPTIONS = {"num_threads": 1, "max_num_seqs": 8}
READER = "test-rdt"  # this module's reader of the decode workers' KV transfer samples


@pytest.fixture(scope="module")
def deployments(tiny_path):
    """(rdt, object store): each (url, [prefill, decode]), on one two-node cluster."""
    with two_node_cluster(num_prefill_slots=2, num_decode_slots=2):
        specs = [ClusterSpec(model=str(tiny_path), namespace=f"pd-{mode}", engine_options=OPTIONS, kv_transport=mode)
                 for mode in ("rdt", "object_store")]
        with router_server(specs[0]) as (rdt_url, rdt_actors, _), router_server(specs[1]) as (store_url, store_actors, _):
            ray.get(rdt_actors[1].stats.remote(READER))  # registered: every transfer from now on is sampled
            yield (rdt_url, rdt_actors), (store_url, store_actors)


def token_ids(url: str, prompt: list[int], max_tokens: int, **extra) -> list[int]:
    body = checks.completion(url, prompt, max_tokens, logprobs=0, return_tokens_as_token_ids=True, **extra)
    return [int(name.removeprefix("token_id:")) for name in body["choices"][0]["logprobs"]["tokens"]]


def rdt_objects(actor) -> int:
    """RDT objects whose primary copy this worker holds (the KV it put and nobody has dropped yet)."""
    return ray.get(actor.__ray_call__.remote(
        lambda self: ray._private.worker.global_worker.rdt_manager.rdt_store.get_num_objects()))


def test_both_worker_kinds_move_kv_over_nixl(deployments):
    (_, rdt_actors), (_, store_actors) = deployments
    specs = [ray.get(a.worker_spec.remote()) for a in rdt_actors + store_actors]
    assert [(s.worker_id, s.kv_transport, s.tensor_transport) for s in specs] == [
        ("prefill-0", "rdt", "nixl"), ("decode-0", "rdt", "nixl"),
        ("prefill-0", "object_store", None), ("decode-0", "object_store", None)]


def test_greedy_token_ids_equal_the_object_store_deployments(deployments, tiny_path):
    """Prompts of under one block, one block, many blocks and 1,000 tokens, each sent twice (the
    repeat a prefix-cache hit on the prefill worker): the token ids of the object-store deployment
    and of the single engine; the decode worker sampled one transfer of the whole prompt's float32
    KV per request, none failed."""
    (rdt_url, (_, decode)), (store_url, _) = deployments
    prompts = [*checks.prompts(3, 500), [1] + [5 + i % 400 for i in range(999)]]
    want = [o.token_ids for o in Engine(model=str(tiny_path)).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    failures = ray.get(decode.stats.remote(READER)).kv_transfer_failures
    transferred = []  # read after each request: a reader silent past the log's reader_ttl (60 s) is forgotten
    for prompt, expected in zip(prompts, want):
        for _ in range(2):
            assert token_ids(store_url, prompt, 16) == expected
            assert token_ids(rdt_url, prompt, 16) == expected
            stats = ray.get(decode.stats.remote(READER))
            transferred += [nbytes for _, nbytes in stats.kv_transfers]
    assert transferred == [4 * 2 * len(p) * 2 * 16 * 4 for p in prompts for _ in "ab"]
    assert stats.kv_transfer_failures == failures


def test_no_kv_outlives_its_request(deployments):
    """Once answered, the decode worker holds no block and the prefill worker no RDT object (the
    router's ref to the list and the decode worker's borrow are gone: the owner frees it)."""
    (rdt_url, (prefill, decode)), _ = deployments
    total = ray.get(decode.stats.remote()).num_kv_blocks
    token_ids(rdt_url, [1] + list(range(40, 140)), 8)
    wait_for(lambda: rdt_objects(prefill) == 0, "the prefill worker still holds an RDT object", 30)
    assert checks.wait_until_idle([decode])[0].num_free_kv_blocks == total


def held_leases(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: len(self.kv_leases)))


def test_the_prefill_worker_holds_the_kv_until_the_decode_worker_has_read_it(deployments):
    """The prefill worker keeps its own ref to the KV it put (Ray 2.60 can free an object whose ref
    travels nested in a streamed item before its reader's borrow counts: ray-project/ray#58080)
    until the decode worker's fetch ends the lease; then the object goes."""
    (_, (prefill, decode)), _ = deployments
    prompt, params = [1, 5, 6, 7, 9], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    stream = prefill.prefill.remote(PrefillRequest("held", prompt, params))
    meta = ray.get(next(stream))
    kv_ref = next(stream)
    del stream
    assert held_leases(prefill) == 1 and rdt_objects(prefill) == 1
    channel = decode.channel.remote("test-held")
    ray.get(decode.admit.remote(DecodeRequest("held", prompt, params, meta.first_token_id, meta.first_logprobs),
                                [kv_ref], "test-held"))  # returns once the KV is fetched
    del kv_ref
    wait_for(lambda: held_leases(prefill) == 0, "the lease was not ended", 30)
    wait_for(lambda: rdt_objects(prefill) == 0, "the prefill worker still holds an RDT object", 30)
    deltas = []
    while not deltas or deltas[-1].finish_reason is None:
        deltas += [delta for _, delta in ray.get(next(channel), timeout=60)]
    tokens = [t for d in deltas for t in d.token_ids]  # the two after the prefill's first, from the read KV
    assert (len(tokens), deltas[-1].finish_reason, any(d.kv_lost for d in deltas)) == (2, "length", False)
    ray.cancel(channel)


def test_a_first_token_that_ends_the_request_exports_no_kv(deployments):
    """A stop on the first token: the router will not read the KV, so none is put (over RDT it would
    sit under a lease nobody ends)."""
    (_, (prefill, _)), _ = deployments
    prompt = [1, 5, 6, 7, 8]
    first = ray.get(next(prefill.prefill.remote(PrefillRequest("probe", prompt, SamplingParams(max_tokens=1,
                                                                                                temperature=0)))))
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first.first_token_id])
    items = [ray.get(ref) for ref in prefill.prefill.remote(PrefillRequest("stopped", prompt, params))]
    assert [(m.first_token_id, m.finish_reason, m.kv_lease) for m in items] == [(first.first_token_id, "stop", None)]
    wait_for(lambda: held_leases(prefill) == 0 and rdt_objects(prefill) == 0, "the KV was put", 30)


FOUR_TOKENS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, seed=1)


def second_router(workers: dict) -> Orchestrator:
    """A router in this test process over the deployment's `workers` (no stats poll: a worker it marks dead stays so)."""
    pool = WorkerPool("pd-rdt")
    pool.discover(workers)
    return Orchestrator(pool, "disaggregated")


@pytest.mark.parametrize("leaves", ["after_the_first_token", "with_no_decode_worker"])
def test_a_router_that_drops_the_kv_unread_ends_its_lease(deployments, leaves):
    """A router (a second one, in this process, over the same workers) whose client leaves right
    after the first token, or that has no decode worker to hand the KV to (503): it ends the lease
    itself, so the KV goes at once, not when the lease runs out (120 s)."""
    (_, (prefill, decode)), _ = deployments
    workers = {"prefill-0": prefill} if leaves == "with_no_decode_worker" else {"prefill-0": prefill, "decode-0": decode}
    router = second_router(workers)

    async def ask() -> list:
        stream, deltas = router.generate(f"dropped-{leaves}", [1, 5, 6, 7, 11], FOUR_TOKENS), []
        try:
            deltas.append(await stream.__anext__())
            if leaves == "with_no_decode_worker":
                deltas.append(await stream.__anext__())
        finally:
            await stream.aclose()
        return deltas

    if leaves == "with_no_decode_worker":
        with pytest.raises(APIError, match="no decode worker is alive"):
            asyncio.run(ask())
    else:
        assert len(asyncio.run(ask())[0].token_ids) == 1
    wait_for(lambda: held_leases(prefill) == 0 and rdt_objects(prefill) == 0, "the KV waits for its lease", 30)


def test_many_handovers_lose_no_kv(deployments):
    """Sixty requests in a row through the router: every KV fetched, none recomputed."""
    (rdt_url, (prefill, decode)), _ = deployments
    failures = ray.get(decode.stats.remote()).kv_transfer_failures
    for i in range(60):
        assert len(token_ids(rdt_url, [1, 30 + i, 31, 32], 2)) == 2
    assert ray.get(decode.stats.remote()).kv_transfer_failures == failures
    wait_for(lambda: held_leases(prefill) == 0 and rdt_objects(prefill) == 0, "KV outlived its request", 30)


@pytest.mark.parametrize("fault", ["corrupt", "lose"])
def test_a_corrupt_or_lost_device_kv_is_recomputed(deployments, tiny_path, fault):
    """The decode worker flips one bit of the next DeviceKV it fetches (caught by the checksum taken
    on the prefill worker) or fails the fetch: the request fails there with kv_lost, the router has
    the prompt recomputed on the decode side, and the answer is the single engine's."""
    (rdt_url, (prefill, decode)), _ = deployments
    prompt = [1, 9, 8, 7, 6, 5]
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    want = Engine(model=str(tiny_path)).generate([prompt], params)[0].token_ids
    checks.check_kv_fault_recomputed(decode, fault, len(prompt), 12,
                                     lambda: token_ids(rdt_url, prompt, 12, temperature=0.7, seed=5), want)
    wait_for(lambda: rdt_objects(prefill) == 0, "the prefill worker still holds an RDT object", 30)


def test_kv_whose_prefill_worker_died_is_lost_not_hung(deployments):
    """The prefill worker that put the KV dies before the decode worker reads it: the fetch fails,
    and the decode worker reports the KV lost (the router would recompute the prompt). Last: the
    deployment's prefill worker restarts (Ray's max_restarts)."""
    (_, (prefill, decode)), _ = deployments
    prompt = [1, 5, 6, 7, 8]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    meta_ref, kv_ref = list(prefill.prefill.remote(PrefillRequest("orphaned", prompt, params)))
    meta = ray.get(meta_ref)
    failures = ray.get(decode.stats.remote()).kv_transfer_failures
    assert rdt_objects(prefill) == 1  # the KV, put there: what the ref this test holds points to
    crash_and_restart(prefill, 180)  # the old process gone, its KV with it
    channel = decode.channel.remote("test-orphaned")
    request = DecodeRequest("orphaned", prompt, params, meta.first_token_id, meta.first_logprobs)
    ray.get(decode.admit.remote(request, [kv_ref], "test-orphaned"))
    ((request_id, delta),) = ray.get(next(channel), timeout=120)
    assert (request_id, delta.token_ids, delta.kv_lost) == ("orphaned", [], True)
    assert delta.error.startswith("KVTransferError: the KV could not be fetched: ")
    ray.cancel(channel)
    assert ray.get(decode.stats.remote()).kv_transfer_failures == failures + 1


@pytest.mark.parametrize("fault,error,message", [
    ("fail", WorkerFailed, "RuntimeError: test fault: admit failed before the fetch"),
    ("die", APIError, "no decode worker is alive"),
])
def test_a_decode_that_fails_before_reading_the_kv_ends_its_lease(deployments, fault, error, message):
    """The decode worker's admit fails before the fetch with an error that is neither a lost worker nor a lost KV (test
    fault "fail": the request fails), or the worker dies where it would fetch ("die": the router, a second one in this
    process, so no stats poll revives the worker meanwhile, has no decode worker left and answers 503). Either way the
    router ends the lease of the KV nobody read, so the prefill worker lets it go at once, not when the lease runs out
    (120 s). Last: the dead decode worker restarts (Ray's max_restarts)."""
    (_, (prefill, decode)), _ = deployments
    router = second_router({"prefill-0": prefill, "decode-0": decode})
    old_pid = process_id(decode)
    ray.get(decode.__ray_call__.remote(lambda self: setattr(self, "kv_fault", fault)))

    async def ask() -> list:
        return [delta async for delta in router.generate(f"{fault}-unread", [1, 5, 6, 7, 13], FOUR_TOKENS)]

    with pytest.raises(error, match=message):
        asyncio.run(ask())
    wait_for(lambda: held_leases(prefill) == 0 and rdt_objects(prefill) == 0, "the KV waits for its lease", 30)
    if fault == "die":
        wait_restarted(decode, old_pid, 180)
