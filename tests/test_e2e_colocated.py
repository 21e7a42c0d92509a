"""Colocated mode (every worker prefills and decodes) passes the same end-to-end checks."""

from __future__ import annotations

import e2e_checks as checks
import pytest
from cluster_harness import router_server, two_node_cluster

from router.launcher import ClusterSpec
from services.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def server(tiny_path):
    with two_node_cluster(num_decode_slots=2) as _:
        # Known ceilings given: the workers skip their start-up probe and report these.
        spec = ClusterSpec(model=str(tiny_path), mode="colocated", num_colocated=2, namespace="pd-colo",
                           engine_options={"num_threads": 1, "max_num_seqs": 32}, peak_flops=2e12,
                           peak_bytes_per_second=5e10)
        with router_server(spec) as (url, actors, _):
            yield url, actors, str(tiny_path)


def test_greedy_over_http_equals_single_engine(server):
    url, _, model = server
    checks.check_greedy_matches_engine(url, model, checks.prompts(3, 500), Tokenizer.from_folder(model))


def test_openai_client(server):
    url, _, model = server
    checks.check_openai_client(url, "test-model", model)


def test_concurrent_streams(server):
    url, _, model = server
    checks.check_concurrent_streams(url, model, checks.prompts(3, 500))


def test_disconnect_frees_kv(server):
    url, actors, _ = server
    checks.check_disconnect_frees_kv(url, actors)


def test_non_streaming_disconnect_frees_kv(server):
    url, actors, _ = server
    checks.check_non_streaming_disconnect_frees_kv(url, actors)


def test_workers_report_the_given_ceilings(server):
    import ray

    _, actors, _ = server
    stats = [ray.get(a.stats.remote()) for a in actors]
    assert [(s.peak_flops, s.peak_bytes_per_second) for s in stats] == [(2e12, 5e10)] * 2


def test_echo_with_logprobs_scores_the_prompt(server):
    url, _, model = server
    checks.check_echo_logprobs_score_the_prompt(url, model)
