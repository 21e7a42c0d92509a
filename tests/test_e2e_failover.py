"""A decode worker that dies mid-stream: its streams resume on the other decode worker, with no token
lost or repeated (simulated two-node Ray cluster, two decode workers, real HTTP)."""

from __future__ import annotations

import json

import e2e_checks as checks
import httpx
import pytest
import ray
from cluster_harness import crash_and_restart, router_server, set_step_delay, two_node_cluster, wait_for

from router.launcher import ClusterSpec
from services import Engine, SamplingParams
from services.metrics import METRICS

OPTIONS = {"num_threads": 1, "max_num_seqs": 8}
PROMPT = [1, 17, 99, 240, 35, 8]


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster() as nodes:
        yield nodes


def _serving(decode_actors: list) -> list:
    return [a for a in decode_actors if ray.get(a.stats.remote()).num_running > 0]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 42}])
def test_a_stream_survives_its_decode_worker(cluster, tiny_path, mode, sampling):
    max_tokens = 1000
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    expected = Engine(model=str(tiny_path)).generate([PROMPT], params)[0].text
    spec = ClusterSpec(model=str(tiny_path), mode=mode, namespace=f"pd-failover-{mode}", num_decode=2,
                       num_colocated=2, engine_options=OPTIONS)
    failovers = METRICS.decode_failovers._value.get()
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    with router_server(spec) as (url, actors, _):
        decode_actors = actors[-2:]
        text, usage, killed = "", None, []
        # Paced until the kill (1,000 tokens would take 20 s): the stream is still running when its
        # worker dies, however fast the host; the survivor then runs at full speed.
        set_step_delay(decode_actors, 0.02)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for chunk in checks.chunks(response):
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                usage = chunk.get("usage") or usage
                if len(text) >= 20 and not killed:  # mid-stream: kill the worker decoding it
                    (killed,) = _serving(decode_actors)
                    ray.kill(killed, no_restart=True)
                    set_step_delay([a for a in decode_actors if a is not killed], 0.0)
        assert usage["completion_tokens"] == max_tokens
        assert text == expected  # nothing lost, nothing repeated, the same tokens
        assert METRICS.decode_failovers._value.get() == failovers + 1
        survivor = next(a for a in decode_actors if a is not killed)
        assert ray.get(survivor.stats.remote()).num_running == 0


def test_a_channel_the_worker_closed_resumes_on_the_same_live_worker(cluster, tiny_path):
    """A channel whose lease ran out is closed by a live worker: its streams resume, there included."""
    max_tokens = 1000
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    expected = Engine(model=str(tiny_path)).generate([PROMPT], params)[0].text
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-failover-lease", engine_options=OPTIONS)
    failovers = METRICS.decode_failovers._value.get()
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with router_server(spec) as (url, actors, state):
        decode = actors[1]  # the only decode worker
        text, closed = "", False
        set_step_delay([decode], 0.02)  # until the close: the stream is still running then, however fast the host
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for chunk in checks.chunks(response):
                text += chunk["choices"][0]["text"]
                if len(text) >= 20 and not closed:  # as if the lease ran out: the worker closes the channel
                    ray.get(decode.__ray_call__.remote(
                        lambda self: [self._close(cid, ch) for cid, ch in list(self._channels.items())]))
                    closed = True
                    set_step_delay([decode], 0.0)
        assert text == expected
        assert METRICS.decode_failovers._value.get() == failovers + 1
        assert [w.alive for w in state.pool.workers.values() if w.role == "decode"] == [True]


def test_dead_prefill_workers_are_skipped_then_decode_workers_prefill(cluster, tiny_path):
    """Kill one of two prefill workers: the next request's prefill fails there and is retried on
    the other; kill that one too: a decode worker prefills. Every answer is the single engine's."""
    max_tokens = 24
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    expected = Engine(model=str(tiny_path)).generate([PROMPT], params)[0].text
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-failover-prefill", num_prefill=2, engine_options=OPTIONS)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    failovers = METRICS.prefill_failovers._value.get()
    # No stats polls after the first: only a failed call can tell the router a worker is gone.
    with router_server(spec, stats_interval=3600) as (url, _, state):
        def complete(stream: bool) -> str:
            if not stream:
                answer = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert answer.status_code == 200, answer.text
                return answer.json()["choices"][0]["text"]
            text = ""
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as answer:
                for chunk in checks.chunks(answer):
                    text += chunk["choices"][0]["text"]
            return text

        assert complete(stream=False) == expected
        first, second = state.pool.role("prefill")  # an idle pool picks the first
        ray.kill(first.actor, no_restart=True)
        assert complete(stream=True) == expected
        assert METRICS.prefill_failovers._value.get() == failovers + 1
        ray.kill(second.actor, no_restart=True)
        assert complete(stream=False) == expected
        assert complete(stream=True) == expected
        assert METRICS.prefill_failovers._value.get() == failovers + 2
        assert (first.alive, second.alive) == (False, False)
        health = httpx.get(url + "/health", timeout=10)  # still serving: the decode worker prefills
        assert (health.status_code, health.json()) == (200, {"status": "degraded", "missing": ["prefill"]})
        (decode,) = state.pool.role("decode")
        ray.kill(decode.actor, no_restart=True)  # nothing left that can decode: refused, with Retry-After
        health = httpx.get(url + "/health", timeout=10)
        assert (health.status_code, health.json()) == (503, {"status": "unhealthy", "missing": ["decode"]})
        refused = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
        assert refused.json()["error"] == {"message": "no decode worker is alive", "type": "ServiceUnavailableError",
                                           "param": None, "code": 503}



def test_a_request_past_the_deadline_is_answered_504_and_aborted(cluster, tiny_path):
    """--request-timeout: a non-streamed request past it gets a 504 body; a stream gets its tokens so
    far (the single engine's), then a 504 error event and [DONE]; either way the decode worker drops
    it and frees its blocks."""
    # Paced, 1,000 tokens take 10 s at least: far past the 2 s deadline, however fast the host; and
    # at most 200 of them fit in it. 2 s leaves the first token (a prefill and a hop) ample time.
    delay, deadline = 0.01, 2.0
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-deadline", engine_options={**OPTIONS, "step_delay_s": delay})
    body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    engine = Engine(model=str(tiny_path))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=int(deadline / delay) + 10, temperature=0,
                                                   ignore_eos=True))[0]
    want, want_short = out.text, engine.tokenizer.decode(out.token_ids[:5])
    error = {"message": f"the request ran past the server's deadline of {deadline:g} s", "type": "TimeoutError",
             "param": None, "code": 504}
    timeouts = METRICS.request_timeouts._value.get()
    with router_server(spec, request_timeout=deadline) as (url, actors, _):
        decode = actors[1]
        answer = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert (answer.status_code, answer.json()) == (504, {"error": error})
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2]) == {"error": error}
        streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])  # tokens came first...
        assert streamed and want.startswith(streamed)  # ...and they are the engine's
        several = httpx.post(url + "/v1/completions", json={**body, "n": 2, "seed": 1, "temperature": 0.5}, timeout=30)
        assert (several.status_code, several.json()) == (504, {"error": error})  # n > 1: every choice stops
        assert METRICS.request_timeouts._value.get() == timeouts + 3
        short = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=30)
        assert short.status_code == 200, short.text
        assert (short.json()["choices"][0]["text"], short.json()["usage"]["completion_tokens"]) == (want_short, 5)
        checks.wait_until_idle([decode])  # nothing running there, every block free


def test_a_killed_worker_is_started_again_and_serves_again(cluster, tiny_path, monkeypatch):
    """`pdserve serve --worker-restarts 1`: Ray restarts a dead worker once (it reloads the model, the
    router finds it at its next stats poll, and the answers are the single engine's again); killed a
    second time, it stays dead."""
    import dataclasses

    import router.launcher
    from router.cli import main

    captured = {}  # the spec `pdserve serve` builds from its flags, run here on the test cluster
    monkeypatch.setattr(router.launcher, "serve", lambda spec, *args, **options: captured.update(spec=spec))
    main(["serve", "--model", str(tiny_path), "--namespace", "pd-restart", "--worker-restarts", "1",
          "--max-num-seqs", "8", "--kv-cache-memory-gb", "0.1"])
    spec = dataclasses.replace(captured["spec"], engine_options={**captured["spec"].engine_options, "num_threads": 1})
    assert spec.max_restarts == 1
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = Engine(model=str(tiny_path)).generate([PROMPT], params)[0].text
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with router_server(spec) as (url, actors, state):
        decode = actors[1]
        crash_and_restart(decode, 90)
        wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 200,
                 "the router never found the restarted worker", 30, 0.2)  # at its next stats poll
        answer = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
        (worker,) = state.pool.role("decode")
        assert worker.alive and ray.get(decode.stats.remote()).num_tokens_processed == 11  # a fresh engine's
        ray.kill(decode, no_restart=False)  # its one restart is spent: this time it stays dead

        def dead() -> bool:
            try:
                ray.get(decode.ping.remote(), timeout=10)
                return False
            except ray.exceptions.ActorDiedError:
                return True
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False  # e.g. the kill is still on its way

        wait_for(dead, "the decode worker was restarted beyond --worker-restarts", 60, 0.2)
