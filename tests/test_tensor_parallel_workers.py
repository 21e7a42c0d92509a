"""Tensor-parallel workers end to end on a simulated Ray cluster (gloo, CPU): groups of rank actors
in placement groups, seen by the router as one worker each; KV handed between groups of different
sizes; a rank's death takes its group down and the stream resumes elsewhere; refusals at start-up."""

from __future__ import annotations

import httpx
import pytest
import ray
from cluster_harness import process_id, router_server, set_step_delay, wait_for, wait_restarted
from e2e_checks import chunks
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from router.launcher import ClusterSpec, start_workers
from router.scaler import scale
from services import Engine, SamplingParams
from services.protocol import PrefillRequest

OPTIONS = {"num_threads": 1, "max_num_seqs": 8, "dtype": "float32"}
PROMPT = [1] + [5 + i % 400 for i in range(300)]  # ~300 KB of KV: through the object store


@pytest.fixture(scope="module")
def cluster():
    """A prefill node (2 CPUs: one TP = 2 group) and a decode node (4 CPUs: two TP = 2 groups)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=0, resources={"pd_prefill": 2})
    cluster.add_node(num_cpus=4, num_gpus=0, resources={"pd_decode": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="pdserve-tp-test", logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def expected_text(model, max_tokens: int, **sampling) -> str:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return Engine(model=str(model), **OPTIONS).generate([PROMPT], params)[0].text


def stream(url: str, max_tokens: int, on_chunk=lambda text: None, **sampling) -> tuple[str, dict]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for chunk in chunks(response):
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                on_chunk(text)
            usage = chunk.get("usage") or usage
    return text, usage


def plasma_objects() -> int:
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address  # this module's cluster (others may run on the host)
    for line in memory_summary(address=address, stats_only=True).splitlines():
        if "Plasma memory usage" in line:
            return int(line.split(",")[1].split("objects")[0])
    raise AssertionError("no plasma usage line")


def test_prefill_tp2_to_decode_tp1_frees_the_kv_after_admission_and_scale_adds_groups(cluster, tiny_path):
    expected = expected_text(tiny_path, 60, temperature=0)
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-tp-2to1", engine_options=OPTIONS,
                       prefill_tensor_parallel_size=2)
    with router_server(spec) as (url, actors, _):
        prefill, decode = actors
        ranks = ray.get(prefill.__ray_call__.remote(lambda self: len(self.rank_group.ranks)))
        assert ranks == 1  # rank 0 is the named worker; one more rank actor
        seen = []

        def mid_stream(text: str) -> None:  # the decode worker has admitted it: the KV object is gone
            if len(text) > 10 and not seen:
                wait_for(lambda: plasma_objects() == 0, "the KV object outlived its admission", 30)
                seen.append(text)

        ray.get(decode.stats.remote("test"))  # a reader from now on: it will get the KV transfer's sample
        set_step_delay([decode], 0.02)
        text, usage = stream(url, 60, mid_stream, temperature=0)
        assert seen and text == expected and usage["completion_tokens"] == 60
        stats = ray.get(decode.stats.remote("test"))
        assert [b for _, b in stats.kv_transfers] == [4 * 2 * len(PROMPT) * 2 * 16 * 4]  # both slices
        meta_ref, kv_ref = list(prefill.prefill.remote(PrefillRequest("direct", PROMPT, SamplingParams(temperature=0))))
        kv = ray.get(kv_ref)
        kv.verify(4, 2, 16, "float32")  # both ranks' slices, each with the checksum its side computed
        assert [(s.head_start, s.data.flags.writeable) for s in kv.slices] == [(0, False), (1, False)]  # read in place
        del meta_ref, kv_ref, kv
        prefill_stats = ray.get(prefill.stats.remote("test"))
        assert (prefill_stats.worker_id, prefill_stats.device) == ("prefill-0", "cpu x 2 ranks")

        # pdserve scale adds a whole decode group of 2 ranks (its own placement group), then removes it.
        assert scale("pd-tp-2to1", {"decode": 2}, tensor_parallel_sizes={"decode": 2}) == {
            "added": ["decode-1"], "removed": []}
        added = ray.get_actor("decode-1", namespace="pd-tp-2to1")
        assert ray.get(added.stats.remote("test")).device == "cpu x 2 ranks"
        group = ray.get(added.placement_group.remote())
        assert placement_group_table(group)["strategy"] == "STRICT_PACK"
        assert scale("pd-tp-2to1", {"decode": 1}, drain_timeout=5) == {"added": [], "removed": ["decode-1"]}
        wait_for(lambda: placement_group_table(group)["state"] == "REMOVED", "the group's placement group stayed", 30)


def test_decode_tp2_rank_death_resumes_the_stream_elsewhere(cluster, tiny_path):
    """Prefill TP = 1 hands off to decode groups of TP = 2; killing rank 1 of the group decoding a
    stream takes that group down, the stream completes on the other group, uninterrupted, and Ray
    starts the group again (rank 0 restarts and starts a fresh rank 1)."""
    sampling = {"temperature": 0.8, "seed": 42}
    expected = expected_text(tiny_path, 400, **sampling)
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-tp-1to2", engine_options=OPTIONS, num_decode=2,
                       decode_tensor_parallel_size=2, max_restarts=1)
    with router_server(spec) as (url, actors, _):
        decode_actors = actors[1:]
        killed = []

        def kill_a_rank(text: str) -> None:
            if len(text) >= 20 and not killed:
                (serving,) = [a for a in decode_actors if ray.get(a.stats.remote()).num_running > 0]
                (rank,) = ray.get(serving.__ray_call__.remote(lambda self: self.rank_group.ranks))
                killed.append((serving, process_id(serving)))
                ray.kill(rank, no_restart=True)
                set_step_delay([a for a in decode_actors if a is not serving], 0.0)

        set_step_delay(decode_actors, 0.02)
        text, usage = stream(url, 400, kill_a_rank, **sampling)
        assert killed and usage["completion_tokens"] == 400
        assert text == expected  # nothing lost, nothing repeated
        ((group, old_pid),) = killed
        wait_restarted(group, old_pid, 120)
        (fresh,) = ray.get(group.__ray_call__.remote(lambda self: self.rank_group.ranks))
        assert ray.get(fresh.ping.remote(), timeout=30) == 1
        assert ray.get(group.stats.remote("test")).num_steps == 0  # a new process: its engine is fresh


def test_refusals_name_the_numbers(cluster, tiny_path):
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-tp-bad", engine_options=OPTIONS,
                       decode_tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide this model: 4 attention heads"):
        start_workers(spec, local=False)
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-tp-big", engine_options=OPTIONS,
                       prefill_tensor_parallel_size=4)
    with pytest.raises(RuntimeError, match=r"1 prefill worker\(s\) of tensor-parallel size 4 need 4 CPUs each on one "
                                           r"node, but the nodes that take prefill workers hold at most 2 CPUs"):
        start_workers(spec, local=False)
