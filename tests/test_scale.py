"""`pdserve scale` on a running deployment (simulated two-node cluster, real router over loopback):
new workers are placed like their role's, the router finds them; a removed decode worker drains,
and a stream it still runs when it is killed resumes on another with the single engine's text."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import e2e_checks as checks
import pytest
import ray
from cluster_harness import router_server, set_step_delay, two_node_cluster, wait_for

from router.cli import build_parser, main
from router.launcher import ClusterSpec
from router.scaler import scale
from router.worker_pool import named_workers
from services.metrics import METRICS
from services.sampling_params import SamplingParams

OPTIONS = {"num_threads": 1, "max_num_seqs": 8}
NAMESPACE = "pd-scale"


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster(num_prefill_slots=2, num_decode_slots=2) as nodes:
        yield nodes


def test_scale_up_then_down_with_the_router_running(cluster, tiny_path):
    from services import Engine

    _, prefill_node, decode_node = cluster
    spec = ClusterSpec(model=str(tiny_path), namespace=NAMESPACE, engine_options=OPTIONS)
    with router_server(spec) as (url, _, state):
        pool = state.pool
        assert scale(NAMESPACE, {"prefill": 2, "decode": 2}) == {"added": ["prefill-1", "decode-1"], "removed": []}
        for name, node in (("prefill-1", prefill_node), ("decode-1", decode_node)):  # placed like their role's
            assert ray.get(ray.get_actor(name, namespace=NAMESPACE).stats.remote()).node_id == node
        wait_for(lambda: {w.name for w in pool.role("prefill") + pool.role("decode")}
                  == {"prefill-0", "prefill-1", "decode-0", "decode-1"}, "the router never found the new workers")

        # Two long streams at once: the second goes to decode-1 (the least loaded), which is then
        # removed while it streams: drained (no new work), killed, and its stream resumes on decode-0.
        # decode-1 is paced (400 tokens would take it 20 s): its stream is still running when it
        # is removed, however fast the host.
        prompts = [[1, 40, 41, 42, 43], [1, 50, 51, 52, 53]]
        engine = Engine(model=str(tiny_path))
        want = [o.text for o in engine.generate(prompts, SamplingParams(max_tokens=400, temperature=0,
                                                                        ignore_eos=True))]
        decode_1 = ray.get_actor("decode-1", namespace=NAMESPACE)
        # A draining worker gets nothing new from the router (from its next stats poll on).
        ray.get(decode_1.drain.remote())
        wait_for(lambda: pool.workers["decode-1"].draining, "the router never saw decode-1 draining")
        before = ray.get(decode_1.stats.remote()).num_tokens_processed
        with ThreadPoolExecutor(3) as threads:
            assert all(f.result()["usage"]["completion_tokens"] == 4 for f in
                       [threads.submit(checks.completion, url, [1, 60 + i, 61], 4) for i in range(3)])
        assert ray.get(decode_1.stats.remote()).num_tokens_processed == before
        ray.get(decode_1.drain.remote(False))  # back in service
        wait_for(lambda: not pool.workers["decode-1"].draining, "the router never saw decode-1 back")
        failovers = METRICS.decode_failovers._value.get()
        set_step_delay([decode_1], 0.05)
        with ThreadPoolExecutor(2) as threads:
            streams = [threads.submit(checks.streamed_text, url, p, 400) for p in prompts]
            wait_for(lambda: ray.get(decode_1.stats.remote()).num_running == 1, "decode-1 got no stream")
            assert scale(NAMESPACE, {"decode": 1}, drain_timeout=0.0) == {"added": [], "removed": ["decode-1"]}
            assert [f.result()[0] for f in streams] == want
        assert METRICS.decode_failovers._value.get() == failovers + 1  # killed mid-stream, resumed on decode-0
        with pytest.raises(ValueError):
            ray.get_actor("decode-1", namespace=NAMESPACE)
        wait_for(lambda: "decode-1" not in pool.workers and "decode-1" not in state.orchestrator.channels,
                  "the router still lists the removed worker")
        checks.check_greedy_matches_engine(url, str(tiny_path), checks.prompts(3, 400), engine.tokenizer)
        assert scale(NAMESPACE, {"prefill": 1}) == {"added": [], "removed": ["prefill-1"]}


def test_scale_refuses_what_it_cannot_do(cluster, tiny_path):
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-scale-refusals", engine_options=OPTIONS)
    with router_server(spec):
        with pytest.raises(RuntimeError, match=r"the workers to add need 2 of 'pd_decode' but the cluster has 1 free"):
            scale("pd-scale-refusals", {"prefill": 2, "decode": 3})  # decode: 2 slots, 1 taken; prefill: room
        with pytest.raises(ValueError, match="every role keeps at least one worker"):
            scale("pd-scale-refusals", {"decode": 0})
        with pytest.raises(RuntimeError, match="has no prefill worker to copy"):
            scale("pd-nothing-here", {"prefill": 2})
        assert list(named_workers("pd-scale-refusals")) == ["decode-0", "prefill-0"]  # nothing changed


def test_scale_cli_flags():
    args = build_parser().parse_args(["scale", "--decode", "3", "--drain-timeout", "5"])
    assert (args.address, args.namespace, args.prefill, args.decode, args.drain_timeout) == ("auto", "pdserve", None,
                                                                                             3, 5.0)
    for bad in (["scale", "--decode", "0"], ["scale", "--drain-timeout", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_scale_without_counts_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["scale"])
    assert exit_info.value.code == 2 and "--prefill N and/or --decode M" in capsys.readouterr().err
