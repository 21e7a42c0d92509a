"""Disaggregated serving end to end on a simulated two-node Ray cluster (prefill node, decode node):
KV really crosses Ray's object manager; requests go through uvicorn over loopback."""

from __future__ import annotations

import e2e_checks as checks
import httpx
import pytest
import ray
from cluster_harness import router_server, serve_router, step_delay, two_node_cluster, wait_for

from router.launcher import ClusterSpec
from services.kv_payload import KVPayload, KVSlice
from services.protocol import PrefillRequest
from services.sampling_params import SamplingParams
from services.tokenizer import Tokenizer

OPTIONS = {"num_threads": 1, "max_num_seqs": 32}


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster(num_prefill_slots=3) as nodes:  # the module server holds one; a test starts two more
        yield nodes


@pytest.fixture(scope="module")
def tiny_server(cluster, tiny_path):
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-tiny", engine_options=OPTIONS)
    with router_server(spec) as (url, actors, state):
        yield url, actors, str(tiny_path)


def test_workers_run_on_their_role_nodes(cluster, tiny_server):
    _, prefill_node, decode_node = cluster
    _, actors, _ = tiny_server
    stats = [ray.get(a.stats.remote()) for a in actors]
    assert [(s.worker_id, s.node_id) for s in stats] == [("prefill-0", prefill_node), ("decode-0", decode_node)]


def test_greedy_over_http_equals_single_engine_tiny(tiny_server):
    url, _, model = tiny_server
    checks.check_greedy_matches_engine(url, model, checks.prompts(3, 500), Tokenizer.from_folder(model))


def test_greedy_over_http_equals_single_engine_stories(cluster, stories_path):
    spec = ClusterSpec(model=str(stories_path), namespace="pd-stories", engine_options=OPTIONS)
    with router_server(spec) as (url, _, _):
        checks.check_greedy_matches_engine(url, str(stories_path), checks.prompts(3, 512),
                                           Tokenizer.from_folder(stories_path))


def test_kv_crosses_nodes_with_its_checksum_and_is_freed_with_the_reference(tiny_server):
    _, actors, _ = tiny_server
    prefill, decode = actors
    prompt = [1] + [5 + i % 400 for i in range(1000)]  # ~1 MB of KV: in the object store, not inline
    _wait_for_plasma_objects(0)  # so that what is counted below is this KV
    meta, kv_ref = direct_prefill(prefill, PrefillRequest("direct", prompt, SamplingParams(temperature=0)))
    kv: KVPayload = ray.get(kv_ref)
    assert meta.kv_bytes == kv.num_bytes == 4 * 2 * len(prompt) * 2 * 16 * 4
    kv.verify(4, 2, 16, "float32")  # the checksum computed on the prefill node holds here
    # The primary copy (prefill node) and one on this node; the store's figures lag a little.
    wait_for(lambda: _plasma_objects() >= 1, "the KV is not in the object store", 30)
    del kv, kv_ref
    _wait_for_plasma_objects(0)
    stats = ray.get(decode.stats.remote())  # drains transfers; the router's poller may have taken some
    assert stats.kv_transfer_failures == 0


def test_every_reader_of_a_worker_gets_its_kv_transfer_samples(tiny_server):
    """Several routers poll one decode worker; each must see every KV transfer (a report used to
    hand its samples to whichever caller asked first)."""
    url, actors, _ = tiny_server
    decode = actors[1]
    for reader in ("router-a", "router-b"):
        ray.get(decode.stats.remote(reader))  # both registered, nothing pending for either
    prompt = [1] + [7 + i % 300 for i in range(700)]
    checks.completion(url, prompt, 2)
    seen = [ray.get(decode.stats.remote(reader)).kv_transfers for reader in ("router-a", "router-b")]
    assert len(seen[0]) == 1 and seen[0] == seen[1]  # the router's own poller read it too
    assert seen[0][0][1] == 4 * 2 * len(prompt) * 2 * 16 * 4  # float32 KV of the tiny preset, in bytes
    assert [ray.get(decode.stats.remote(reader)).kv_transfers for reader in ("router-a", "router-b")] == [(), ()]


def direct_prefill(prefill_actor, request: PrefillRequest):
    """Call a prefill worker as the router does: (metadata, KV reference)."""
    stream = prefill_actor.prefill.remote(request)
    meta_ref, kv_ref = list(stream)
    return ray.get(meta_ref), kv_ref


def _plasma_objects() -> int:
    from ray._private.internal_api import memory_summary

    for line in memory_summary(stats_only=True).splitlines():
        if "Plasma memory usage" in line:
            return int(line.split(",")[1].split("objects")[0])
    raise AssertionError("no plasma usage line")


def _wait_for_plasma_objects(expected: int) -> None:
    """Frees are asynchronous, and the store's figures lag (seconds on a loaded host): wait (bounded)
    until the store holds `expected` objects."""
    import time

    deadline = time.monotonic() + 30
    while (count := _plasma_objects()) != expected:
        assert time.monotonic() < deadline, f"{count} objects in the store, expected {expected}"
        time.sleep(0.1)


def test_openai_client(tiny_server):
    url, _, model = tiny_server
    checks.check_openai_client(url, "test-model", model)


def test_concurrent_streams_interleave_and_equal_solo(tiny_server):
    url, _, model = tiny_server
    checks.check_concurrent_streams(url, model, checks.prompts(3, 500))


def test_disconnect_mid_stream_frees_decode_kv(tiny_server):
    url, actors, _ = tiny_server
    checks.check_disconnect_frees_kv(url, actors[1:])


def test_bad_requests_get_openai_errors(tiny_server):
    url, _, _ = tiny_server
    cases = [
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "", "max_tokens": 3}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": [1] * 2048}, "input_tokens"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": [1, 99999]}, "prompt"),
    ]
    for body, param in cases:
        response = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError", error
    response = httpx.post(url + "/v1/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json", "x-request-id": "abc"})
    assert response.status_code == 400 and response.headers["x-request-id"] == "abc"
    response = httpx.post(url + "/v1/completions", json={"prompt": "hi", "model": "nope"}, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert "maximum context length is" in httpx.post(url + "/v1/completions", json=cases[3][0]).json()["error"][
        "message"]


def test_kv_object_is_freed_mid_stream_once_the_decode_worker_has_it(tiny_server):
    import asyncio

    from router.orchestrator import Orchestrator
    from router.worker_pool import WorkerPool

    pool = WorkerPool("pd-tiny")
    pool.discover()
    orchestrator = Orchestrator(pool, "disaggregated")
    prompt = [1] + [5 + i % 400 for i in range(400)]  # 400 KB of KV: stored in the object store
    decode = tiny_server[1][1]
    seen = []

    async def run():
        params = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)  # 75 s at least, paced
        async for delta in orchestrator.generate("mid-stream", prompt, params):
            seen.append(delta)
            if len(seen) == 1:  # the first token came from prefill: the KV waits in the store
                wait_for(lambda: _plasma_objects() >= 1, "the KV is not in the object store", 30)
            if len(seen) == 2:  # decoding has started, so the KV was copied: the object goes away
                _wait_for_plasma_objects(0)
                assert ray.get(decode.stats.remote()).num_running == 1  # ...while the stream goes on
                return  # closing the stream here aborts the request

    _wait_for_plasma_objects(0)  # so that what is counted in run() is this request's KV
    with step_delay([decode], 0.05):  # still running after the waits below, however slow the store's figures
        asyncio.run(run())


def test_corrupt_kv_fails_its_request_only_and_is_counted(tiny_server):
    import numpy as np

    from services.protocol import DecodeRequest

    url, actors, _ = tiny_server
    prefill, decode = actors
    prompt = [1, 5, 6, 7]
    failures = ray.get(decode.stats.remote()).kv_transfer_failures
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    meta, kv_ref = direct_prefill(prefill, PrefillRequest("bad", prompt, params))
    kv = ray.get(kv_ref)
    data = kv.data.copy()
    data.reshape(-1).view(np.uint8)[100] ^= 1
    bad = KVPayload((KVSlice(data, kv.checksum),), kv.dtype)
    request = DecodeRequest("bad", prompt, params, meta.first_token_id, meta.first_logprobs)
    channel = decode.channel.remote("test-corrupt")
    assert ray.get(decode.admit.remote(request, [ray.put(bad)], "test-corrupt")) is None  # failures go to the channel
    ((request_id, delta),) = ray.get(next(channel))
    assert request_id == "bad" and delta.token_ids == [] and delta.finish_reason is None
    assert delta.error.startswith("KVTransferError: ") and "checksum mismatch" in delta.error
    assert delta.kv_lost  # the router may recompute the prompt (next test)
    ray.cancel(channel)
    assert ray.get(decode.stats.remote()).kv_transfer_failures == failures + 1
    assert checks.completion(url, prompt, 5)["choices"][0]["finish_reason"] == "length"  # others go on


@pytest.mark.parametrize("fault", ["corrupt", "lose"])
def test_the_router_recomputes_a_prompt_whose_kv_is_corrupt_or_lost(tiny_server, fault):
    """Over HTTP, through the real prefill -> admit path: the decode worker corrupts (one byte
    flipped: the checksum fails) or loses (the fetch fails) the next KV it fetches, a test-only
    fault; the request fails there with kv_lost, the router has the prompt recomputed on the
    decode side, and the answer is the single engine's."""
    from services import Engine

    url, actors, model = tiny_server
    prompt = [1, 9, 8, 7, 6, 5]
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    want = Engine(model=model).generate([prompt], params)[0].text

    def ask() -> tuple[str, int]:
        body = checks.completion(url, prompt, 12, temperature=0.7, seed=5)
        return body["choices"][0]["text"], body["usage"]["completion_tokens"]
    checks.check_kv_fault_recomputed(actors[1], fault, len(prompt), 12, ask, (want, 12))


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_endpoint_reports_router_and_worker_series(tiny_server):
    """The samples one request adds, measured around it: its TTFT, 3 inter-token gaps, its latency,
    4 + 4 tokens, one success, one prefill queue time and one KV transfer (the workers' series come
    with a stats poll of the router: every second, and on /health)."""
    url, _, _ = tiny_server
    # Each /health polls the workers now: what earlier tests left is recorded before `before` (twice:
    # a background poll already in flight during the first records its samples by the second's end).
    for _ in range(2):
        httpx.get(url + "/health")
    before, now = _scrape(url), {}

    def added(name: str) -> float:
        return now.get(name, 0.0) - before.get(name, 0.0)

    def reported() -> bool:
        httpx.get(url + "/health")
        now.update(_scrape(url))
        return bool(added("pdserve:kv_transfer_bytes_count") and added("pdserve:request_queue_time_seconds_count"))

    checks.completion(url, [1, 2, 3, 4], 4)
    wait_for(reported, "the workers' series never reached the metrics", 10, 0.2)
    assert {name: added(name) for name in (
        "pdserve:time_to_first_token_seconds_count", "pdserve:inter_token_latency_seconds_count",
        "pdserve:e2e_request_latency_seconds_count", "pdserve:prompt_tokens_total", "pdserve:generation_tokens_total",
        'pdserve:request_success_total{finished_reason="length"}', "pdserve:request_prefill_time_seconds_count",
        "pdserve:request_decode_time_seconds_count", "pdserve:request_queue_time_seconds_count",
        "pdserve:kv_transfer_bytes_count")} == {
        "pdserve:time_to_first_token_seconds_count": 1, "pdserve:inter_token_latency_seconds_count": 3,
        "pdserve:e2e_request_latency_seconds_count": 1, "pdserve:prompt_tokens_total": 4,
        "pdserve:generation_tokens_total": 4, 'pdserve:request_success_total{finished_reason="length"}': 1,
        "pdserve:request_prefill_time_seconds_count": 1, "pdserve:request_decode_time_seconds_count": 1,
        "pdserve:request_queue_time_seconds_count": 1, "pdserve:kv_transfer_bytes_count": 1}
    assert added("pdserve:kv_transfer_bytes_sum") == 4 * 2 * 4 * 2 * 16 * 4  # the prompt's float32 KV, in bytes
    values = now
    assert values['pdserve:workers_alive{role="prefill"}'] == 1
    assert values['pdserve:workers_alive{role="decode"}'] == 1
    # Per-phase efficiency: each worker's achieved rate in its own phase over its measured ceiling.
    for worker, rate, utilization, peak in (
            ("prefill-0", "prefill_flops_per_second", "prefill_flops_utilization", "peak_flops_per_second"),
            ("decode-0", "decode_bytes_per_second", "decode_bandwidth_utilization", "peak_bytes_per_second")):
        rate, utilization, peak = (values[f'pdserve:{name}{{worker="{worker}"}}'] for name in (rate, utilization, peak))
        assert rate > 0 and peak > 0 and utilization == pytest.approx(rate / peak, rel=1e-9)


def test_non_streaming_disconnect_frees_kv(tiny_server):
    url, actors, _ = tiny_server
    checks.check_non_streaming_disconnect_frees_kv(url, actors[1:])


def test_closing_a_channel_stops_its_requests_and_frees_their_blocks(tiny_server):
    from services.protocol import DecodeRequest

    _, actors, _ = tiny_server
    decode = actors[1]
    total = ray.get(decode.stats.remote()).num_kv_blocks
    channel = decode.channel.remote("test-close")
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)  # 40 s at least, paced
    with step_delay([decode], 0.02):
        for i in range(3):  # no KV handle: the decode worker prefills them itself
            ray.get(decode.admit.remote(DecodeRequest(f"long-{i}", [1, 2, 3 + i], params), None, "test-close"))
        seen: dict[str, list[int]] = {}
        while len(seen) < 3:
            for request_id, delta in ray.get(next(channel)):
                seen.setdefault(request_id, []).extend(delta.token_ids)
        assert sorted(seen) == ["long-0", "long-1", "long-2"] and ray.get(decode.stats.remote()).num_running == 3
        ray.cancel(channel)  # the router went away: everything it had running there stops
        stats = checks.wait_until_idle([decode])
    assert stats[0].num_free_kv_blocks == total


ORPHAN_ROUTER = r"""
import sys
import ray
from services.protocol import DecodeRequest
from services.sampling_params import SamplingParams
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR")
decode = ray.get_actor("decode-0", namespace=sys.argv[2])
channel = decode.channel.remote("dead-router")
params = SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True)
ray.get(decode.admit.remote(DecodeRequest("orphan", [1, 2, 3], params), None, "dead-router"))
ray.get(next(channel))
print("streaming", flush=True)
sys.stdin.read()  # until killed
"""


def test_a_dead_routers_requests_are_aborted_when_its_channel_lease_runs_out(tiny_server):
    import subprocess
    import sys

    from services import Engine
    from services.metrics import METRICS

    url, actors, model = tiny_server
    decode = actors[1]
    lease, delay = 5.0, 0.02  # seconds; paced, a request of n tokens lasts at least n * delay
    assert 1900 * delay > 5 * lease and 300 * delay > lease  # so the host's speed cannot matter
    before = ray.get(decode.stats.remote())
    # 5 s: the test router renews its own channel every second, with room to spare on a loaded host.
    ray.get(decode.__ray_call__.remote(lambda self: setattr(self, "channel_lease", lease)))
    try:
        with step_delay([decode], delay):
            router = subprocess.Popen([sys.executable, "-c", ORPHAN_ROUTER, ray.get_runtime_context().gcs_address,
                                       "pd-tiny"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert router.stdout.readline().strip() == "streaming"
            assert ray.get(decode.stats.remote()).num_running == 1
            router.kill()  # SIGKILL: no goodbye; Ray keeps the worker's side of the stream open
            router.wait()
            wait_for(lambda: "dead-router" not in ray.get(decode.__ray_call__.remote(lambda self: list(self._channels))),
                     "the dead router's channel was never closed", 30)
            stats = checks.wait_until_idle([decode])
            assert stats[0].num_tokens_processed - before.num_tokens_processed < 1900  # aborted, not finished
            # A live router renews its channel every second: a stream that outlasts the lease goes on,
            # on the same channel (not closed and resumed: no failover).
            params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
            want = Engine(model=model).generate([[1, 2, 3]], params)[0].text
            failovers = METRICS.decode_failovers._value.get()
            assert checks.streamed_text(url, [1, 2, 3], 300)[0] == want
            assert METRICS.decode_failovers._value.get() == failovers
    finally:
        ray.get(decode.__ray_call__.remote(lambda self: setattr(self, "channel_lease", 10.0)))


def test_n_choices_are_seeded_seed_plus_index_through_the_split_path(tiny_server):
    from services import Engine

    url, _, model = tiny_server
    engine = Engine(model=model)
    prompt = [1, 30, 31, 32]
    for seed in (7, 2**63 - 1):  # the last seed wraps: choice 1 uses seed 0
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.8, "seed": seed, "n": 3, "ignore_eos": True}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        out = response.json()
        expected = [engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True,
                                                             seed=(seed + j) % 2**63))[0].text for j in range(3)]
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert [c["text"] for c in out["choices"]] == expected and len(set(expected)) == 3
        assert out["usage"]["completion_tokens"] == 24 and out["usage"]["prompt_tokens"] == 4


def test_logprobs_through_the_split_path_are_the_engines(tiny_server):
    """The first token's logprobs come from the prefill worker, the rest from the decode worker:
    together (streamed or not, completions and chat) they are the single engine's, chosen token
    and top alternatives, named by id (`return_tokens_as_token_ids`)."""
    from services import Engine

    url, _, model = tiny_server
    prompt = [1, 40, 41, 42, 43, 44, 45, 46, 47]
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=21, ignore_eos=True, logprobs=3)
    want = Engine(model=model).generate([prompt], params)[0]
    want_top = [{f"token_id:{k}": v for k, v in lp.items()} for lp in want.logprobs]
    extra = {"temperature": 0.9, "seed": 21, "logprobs": 3, "return_tokens_as_token_ids": True}
    got = checks.completion(url, prompt, 10, **extra)["choices"][0]["logprobs"]
    assert got["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    assert got["token_logprobs"] == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-5)
    assert [top.keys() for top in got["top_logprobs"]] == [top.keys() for top in want_top]
    assert got["top_logprobs"] == [pytest.approx(top, abs=1e-5) for top in want_top]
    _, chunks = checks.streamed_text(url, prompt, 10, **extra)
    streamed = [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == got["token_logprobs"]
    # Without the option a token is named by its text (the legacy format's names may collide).
    plain = checks.completion(url, prompt, 10, **{**extra, "return_tokens_as_token_ids": False})
    tokenizer = Tokenizer.from_folder(model)
    assert plain["choices"][0]["logprobs"]["tokens"] == [tokenizer.token_text(t) for t in want.token_ids]
    messages = [{"role": "user", "content": "tell me a story"}]
    chat_want = Engine(model=model).generate([tokenizer.encode_chat(messages)], params)[0]
    answer = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 10, "temperature": 0.9, "seed": 21, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 3, "return_tokens_as_token_ids": True})
    content = answer.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat_want.token_ids]
    assert [e["logprob"] for e in content] == \
        pytest.approx([lp[t] for t, lp in zip(chat_want.token_ids, chat_want.logprobs)], abs=1e-5)
    assert [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in content] == \
        [pytest.approx({f"token_id:{k}": v for k, v in sorted(lp.items(), key=lambda kv: -kv[1])[:3]}, abs=1e-5)
         for lp in chat_want.logprobs]  # the top 3 (the engine's entry also holds the chosen token)


def test_short_prompts_prefill_on_their_decode_worker(cluster, tiny_path):
    """Conditional disaggregation: a prompt of at most --local-prefill-tokens tokens skips the
    prefill worker and the KV hand-off; a longer one does not. Both answer as the single engine."""
    from services import Engine
    from services.metrics import METRICS

    spec = ClusterSpec(model=str(tiny_path), namespace="pd-local", engine_options=OPTIONS)
    engine = Engine(model=str(tiny_path))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with router_server(spec, local_prefill_tokens=8) as (url, actors, _):
        prefill, decode = actors
        for prompt, where in (([1, 30, 31, 32, 33, 34, 35, 36], "decode"), ([1] + list(range(50, 70)), "prefill")):
            before = {a: ray.get(a.stats.remote()).num_tokens_processed for a in actors}
            local = METRICS.local_prefills._value.get()
            text, _ = checks.streamed_text(url, prompt, 12)
            assert text == engine.generate([prompt], params)[0].text
            after = {a: ray.get(a.stats.remote()).num_tokens_processed for a in actors}
            if where == "decode":  # the prompt and the 11 decode steps, all on the decode worker
                assert (after[prefill] - before[prefill], after[decode] - before[decode]) == (0, len(prompt) + 11)
                assert METRICS.local_prefills._value.get() == local + 1
            else:  # the prompt on the prefill worker; the decode worker feeds only the 11 new tokens
                assert (after[prefill] - before[prefill], after[decode] - before[decode]) == (len(prompt), 11)
                assert METRICS.local_prefills._value.get() == local


def test_the_cost_model_keeps_a_prompt_on_an_idle_decode_worker(cluster, tiny_path):
    """--local-prefill-tokens auto: the first prompt goes to the prefill worker (nothing measured yet);
    once the router has measured the hop, the KV hand-off and the prefill rate, a prompt for an idle
    decode worker stays there (it stalls no stream, and saves the hop and the hand-off). Both answers
    are the single engine's; with the decode worker busy, the next such prompt goes to the prefill worker."""

    from services import Engine
    from services.metrics import METRICS

    # Equal ceilings given, so the model's decode-side prefill rate is exactly the measured one.
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-auto", engine_options=OPTIONS, peak_flops=1e11,
                       peak_bytes_per_second=1e10)
    engine = Engine(model=str(tiny_path))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with router_server(spec, local_prefill_tokens=None) as (url, actors, state):
        prefill, decode = actors
        pool, placement = state.pool, state.orchestrator.placement
        first, second = [1] + list(range(40, 100)), [1] + list(range(140, 200))
        local = METRICS.local_prefills._value.get()
        text, _ = checks.streamed_text(url, first, 12)
        assert text == engine.generate([first], params)[0].text
        assert placement.hop_seconds is not None and METRICS.local_prefills._value.get() == local  # it went remote
        wait_for(lambda: pool.kv_bytes_per_second and pool.best("prefill").prefill_tokens_per_second
                 and not any(w.outstanding or w.reported_requests or w.reported_queued_tokens
                             for w in pool.workers.values()), "the router never measured the rates", 10)
        before = {a: ray.get(a.stats.remote()).num_tokens_processed for a in actors}
        text, _ = checks.streamed_text(url, second, 12)
        assert text == engine.generate([second], params)[0].text
        after = {a: ray.get(a.stats.remote()).num_tokens_processed for a in actors}
        assert (after[prefill] - before[prefill], after[decode] - before[decode]) == (0, len(second) + 11)
        assert METRICS.local_prefills._value.get() == local + 1
        # A decode worker with 1,000 streams (other routers', as it reports them: a test-only knob)
        # would stall them all: the same kind of prompt now goes to the prefill worker.
        third = [1] + list(range(240, 300))
        ray.get(decode.__ray_call__.remote(lambda self: setattr(self, "simulated_requests", 1000)))
        try:
            wait_for(lambda: pool.workers["decode-0"].reported_requests == 1000,
                     "the router never read the decode worker's streams", 10, 0.05)
            text, _ = checks.streamed_text(url, third, 12)
        finally:
            ray.get(decode.__ray_call__.remote(lambda self: setattr(self, "simulated_requests", 0)))
        assert text == engine.generate([third], params)[0].text
        final = {a: ray.get(a.stats.remote()).num_tokens_processed for a in actors}
        assert (final[prefill] - after[prefill], final[decode] - after[decode]) == (len(third), 11)
        assert METRICS.local_prefills._value.get() == local + 1


def test_a_request_the_prefill_queue_cannot_reach_in_time_is_refused_at_once(tiny_server):
    """With --request-timeout, a prompt that would wait past the deadline behind the prefill queue is
    refused now (503 + Retry-After, streamed or not: before any stream starts), not answered 504 later.
    The queue is simulated by the prefill worker reporting 10 million tokens queued (a test-only knob),
    which the router reads through its stats poll."""

    from services.metrics import METRICS

    _, actors, model = tiny_server
    spec = ClusterSpec(model=model, namespace="pd-tiny", engine_options=OPTIONS)  # the same workers, by name

    def simulate_queue(num_tokens: int) -> None:
        ray.get(actors[0].__ray_call__.remote(lambda self: setattr(self, "simulated_queued_tokens", num_tokens)))
        wait_for(lambda: state.pool.best("prefill").reported_queued_tokens == num_tokens,
                 "the router never read the prefill worker's queue", 10, 0.05)

    with serve_router(spec, request_timeout=5.0) as (url, state):
        assert checks.completion(url, [1, 20, 21, 22], 2)["usage"]["completion_tokens"] == 2  # measures the hop
        wait_for(lambda: state.pool.best("prefill").prefill_tokens_per_second,
                 "the router never polled the prefill rate", 10)
        prefill = state.pool.best("prefill")
        refused = METRICS.requests_refused.labels(reason="deadline")._value.get()
        simulate_queue(10**7)
        try:
            assert state.orchestrator.first_token_estimate([1, 30, 31]) > 10**7 / prefill.prefill_tokens_per_second
            for stream in (False, True):
                body = {"model": "test-model", "prompt": [1, 30, 31], "max_tokens": 4, "stream": stream}
                response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
                assert response.status_code == 503
                assert int(response.headers["retry-after"]) >= 1
                error = response.json()["error"]
                assert error["code"] == 503 and "past the server's deadline of 5 s" in error["message"]
        finally:
            simulate_queue(0)
        assert METRICS.requests_refused.labels(reason="deadline")._value.get() == refused + 2
        assert checks.completion(url, [1, 30, 31], 4)["usage"]["completion_tokens"] == 4  # the queue is gone


def test_pdserve_router_attaches_a_router_process_to_running_workers(cluster, tiny_server):
    """`pdserve router` as a real process: it finds the workers by name (mode, model and limits are
    theirs), answers as the single engine does, and SIGTERM stops it without stopping them."""
    import signal
    import subprocess
    import sys

    from cluster_harness import free_port, wait_healthy

    from services import Engine

    ray_cluster, _, _ = cluster
    _, actors, model = tiny_server
    decode = actors[1]
    channels_before = ray.get(decode.__ray_call__.remote(lambda self: sorted(self._channels)))
    port = free_port()
    command = [sys.executable, "-m", "router.cli", "router", "--address", ray_cluster.address, "--namespace",
               "pd-tiny", "--port", str(port), "--served-model-name", "second"]
    router = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(router, url, 90, "pdserve router")
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["second"]
        prompt = [1, 80, 81, 82, 83]
        want = Engine(model=model).generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].text
        body = {"model": "second", "prompt": prompt, "max_tokens": 10, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=60) == 0
        assert "disaggregated mode, serving second" in router.stdout.read()
        assert [ray.get(a.ping.remote()) for a in actors] == ["prefill-0", "decode-0"]  # still running
        # Its channel to the decode worker ends with it (cancelled, or at the latest when its lease runs out).
        wait_for(lambda: ray.get(decode.__ray_call__.remote(lambda self: sorted(self._channels))) == channels_before,
                 "the stopped router's channel is still open", 20, 0.2)
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()


def test_two_routers_share_the_named_workers(tiny_server):
    """A second router attaches to the running workers by name: streams through both routers at
    once are each the single engine's, the decode worker keeps one channel per router, and when
    they end no block is held."""
    from concurrent.futures import ThreadPoolExecutor

    from services import Engine

    url_a, actors, model = tiny_server
    decode = actors[1]
    spec = ClusterSpec(model=model, namespace="pd-tiny", engine_options=OPTIONS)  # the same pool, by name
    prompts = [[1] + [100 + 7 * i + j for j in range(10)] for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = [o.text for o in Engine(model=model).generate(prompts, params)]
    with serve_router(spec) as (url_b, state_b):
        assert sorted(state_b.pool.workers) == ["decode-0", "prefill-0"]
        urls = [url_a, url_b] * 3
        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(lambda up: checks.streamed_text(up[0], up[1], 40)[0], zip(urls, prompts)))
        assert texts == expected
        channels = ray.get(decode.__ray_call__.remote(lambda self: sorted(self._channels)))
        assert len(channels) == 2 and any(c.startswith(state_b.orchestrator.router_id) for c in channels)
    stats = ray.get(decode.stats.remote())
    assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks



def test_a_stop_string_ends_the_request_on_both_sides(tiny_server):
    """A stop string is matched at the router (text cut before it, finish_reason "stop", usage
    counting the tokens up to the match); the decode worker is told and frees the blocks."""
    from services import Engine

    url, actors, model = tiny_server
    decode = actors[1]
    prompt = [1, 60, 61, 62, 63]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    out = Engine(model=model).generate([prompt], params)[0]
    start = next(i for i in range(30, len(out.text)) if "\ufffd" not in out.text[i : i + 3])
    stop = out.text[start : start + 3]
    cut = out.text.index(stop)
    tokenizer = Tokenizer.from_folder(model)
    needed = next(k for k in range(1, 301) if stop in tokenizer.decode(out.token_ids[:k]))
    body = checks.completion(url, prompt, 300, stop=[stop])
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (out.text[:cut], "stop")
    assert body["usage"]["completion_tokens"] == needed
    text, chunks = checks.streamed_text(url, prompt, 300, stop=[stop])
    assert text == out.text[:cut]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == needed
    checks.wait_until_idle([decode])  # nothing running there, every block free


def test_prompts_go_where_their_prefix_is_cached_unless_the_queue_there_costs_more(cluster, tiny_path):
    """Two prefill workers. A prompt sharing a 32-token prefix with an earlier one goes to the worker
    that computed it (32 tokens served from its cache), even with a 20-token prompt queued there; with
    1,000 queued there it goes to the other worker and is computed in full. The queued prompts are
    real requests, held in flight on that worker (its engine's test-only step gate)."""
    from concurrent.futures import ThreadPoolExecutor

    spec = ClusterSpec(model=str(tiny_path), namespace="pd-prefix", num_prefill=2, engine_options=OPTIONS)
    shared = [1] + list(range(300, 331))  # 32 tokens: two whole blocks
    with router_server(spec) as (url, actors, state):
        prefills = {ray.get(a.ping.remote()): a for a in actors[:2]}

        def processed() -> dict[str, int]:
            return {name: ray.get(a.stats.remote()).num_tokens_processed for name, a in prefills.items()}

        def hold(name: str, held: bool) -> None:
            gate = (lambda self: self.engine.engine.step_gate.clear()) if held else \
                (lambda self: self.engine.engine.step_gate.set())
            ray.get(prefills[name].__ray_call__.remote(gate))

        def send(prompt: list[int], queued: list[int] | None = None) -> tuple[dict[str, int], int]:
            """The work each prefill worker did, and `prompt`'s cached tokens; with `queued` first
            held in flight on `first` (where its cached prefix takes it) while `prompt` is placed."""
            before = processed()
            if queued is None:
                body = checks.completion(url, prompt, 2)
            else:
                load = state.pool.workers[first]
                hold(first, True)
                with ThreadPoolExecutor(2) as threads:
                    try:
                        behind = threads.submit(checks.completion, url, queued, 2)
                        wait_for(lambda: load.outstanding == len(queued), "the queued prompt never reached first")
                        answer = threads.submit(checks.completion, url, prompt, 2)
                        wait_for(lambda: answer.done() or load.outstanding > len(queued), "the prompt went nowhere")
                    finally:
                        hold(first, False)
                    body, _ = answer.result(), behind.result()
            after = processed()
            return {n: after[n] - before[n] for n in after}, body["usage"]["prompt_tokens_details"]["cached_tokens"]

        work, cached = send(shared + [5, 6])
        (first,) = [n for n, tokens in work.items() if tokens]
        (other,) = [n for n in prefills if n != first]
        assert (work[first], cached) == (34, 0)
        queued = shared[:16] + [400, 401, 402, 403]  # 20 tokens; 16 of them cached on first
        work, cached = send(shared + [7, 8, 9], queued)
        assert (work, cached) == ({first: 4 + 3, other: 0}, 32)
        queued = shared + [5 + i % 400 for i in range(968)]  # 1,000 tokens; 32 of them cached on first
        work, cached = send(shared + [10, 11], queued)
        assert (work, cached) == ({first: 968, other: 34}, 0)


def test_echo_with_logprobs_scores_the_prompt(tiny_server):
    url, _, model = tiny_server
    checks.check_echo_logprobs_score_the_prompt(url, model)


def test_tokenize_and_detokenize(tiny_server):
    """vLLM's /tokenize and /detokenize: the ids a request would feed the model (a chat's, with its
    template: the same count as the chat completion's prompt_tokens), and back."""
    url, _, model = tiny_server
    tokenizer = Tokenizer.from_folder(model)
    max_model_len = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    ids = tokenizer.encode("hello world")
    assert httpx.post(url + "/tokenize", json={"prompt": "hello world"}).json() == \
        {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    bare = httpx.post(url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("hello world", add_special_tokens=False) != ids
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    answer = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()
    assert answer["usage"]["prompt_tokens"] == chat["count"]
    back = httpx.post(url + "/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    for path, body, status in [("/tokenize", {"prompt": "x", "messages": messages}, 400), ("/tokenize", {}, 400),
                               ("/detokenize", {"tokens": [-1]}, 400), ("/detokenize", {"tokens": [10**6]}, 400),
                               ("/tokenize", {"prompt": "x", "model": "other"}, 404)]:
        refused = httpx.post(url + path, json=body)
        assert refused.status_code == status and refused.json()["error"]["code"] == status, (body, refused.text)


def test_continuous_usage_stats_count_the_tokens_so_far(tiny_server):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    url, _, _ = tiny_server
    prompt = [1, 70, 71, 72, 73]
    _, chunks = checks.streamed_text(url, prompt, 12, stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True})
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counted == sorted(counted) and counted[-1] == 12
    assert all(c["usage"]["prompt_tokens"] == len(prompt) for c in chunks)
    assert all(c["usage"]["total_tokens"] == len(prompt) + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_sampling_options_through_the_split_path_are_the_engines(tiny_server):
    import sampling_checks

    url, _, model = tiny_server
    sampling_checks.check_sampling_options_match_engine(url, model)
    sampling_checks.check_chat_max_completion_tokens(url, model)
