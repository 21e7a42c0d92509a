"""Topology validation, label placement and CLI flag validation (on a small simulated cluster)."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from router.cli import build_parser
from router.launcher import ClusterSpec, start_workers, stop_workers, validate_topology


@pytest.fixture(scope="module")
def labelled_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    prefill = cluster.add_node(num_cpus=1, labels={"pdserve/role": "prefill"})
    decode = cluster.add_node(num_cpus=1, labels={"pdserve/role": "decode"})
    ray.init(address=cluster.address, namespace="pd-launcher", logging_level="WARNING")
    yield prefill.node_id, decode.node_id
    ray.shutdown()
    cluster.shutdown()


def test_missing_resource_fails_fast_with_its_name(labelled_cluster, tiny_path):
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-launcher")
    with pytest.raises(RuntimeError, match="offers 0 of resource 'pd_prefill' but 1 worker"):
        validate_topology(spec)


def test_missing_labels_fail_fast(labelled_cluster, tiny_path):
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-launcher", prefill_labels={"pdserve/role": "prefill"},
                       decode_labels={"pdserve/role": "gpu-decode"})
    with pytest.raises(RuntimeError, match="no live node has the labels"):
        validate_topology(spec)


def test_label_selectors_place_each_role_on_its_node(labelled_cluster, tiny_path):
    prefill_node, decode_node = labelled_cluster
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-launcher", prefill_labels={"pdserve/role": "prefill"},
                       decode_labels={"pdserve/role": "decode"}, engine_options={"num_threads": 1})
    actors = start_workers(spec, local=False)
    try:
        nodes = [ray.get(a.stats.remote()).node_id for a in actors]
        assert nodes == [prefill_node, decode_node]
        assert ray.get_actor("prefill-0", namespace="pd-launcher") is not None
    finally:
        stop_workers(actors)


def test_bad_engine_options_and_model_folder_are_refused(tmp_path):
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        ClusterSpec(model="x", engine_options={"block_size": 0})
    with pytest.raises(ValueError, match="mode must be"):
        ClusterSpec(model="x", mode="mixed")
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        ClusterSpec(model="x", peak_flops=0.0)
    with pytest.raises(ValueError, match="config.json"):
        validate_topology(ClusterSpec(model=str(tmp_path)))


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "0"], ["serve", "--prefill", "0"], ["serve", "--mode", "mixed"],
    ["serve", "--prefill-labels", "role"], ["make-model", "--preset", "huge", "--out", "x"],
    ["generate", "--prompt", "x", "--max-tokens", "-1"], ["generate", "--prompt", "x", "--temperature", "nan"],
    ["serve", "--peak-tflops", "0"], ["serve", "--peak-gbps", "-3"], ["serve", "--peak-gbps", "inf"],
    ["serve", "--peak-tflops", "nan"], ["serve", "--max-pending", "0"], ["serve", "--max-pending", "many"],
    ["serve", "--local-prefill-tokens", "-1"], ["serve", "--request-timeout", "0"], ["serve", "--request-timeout", "x"],
])
def test_cli_refuses_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_parses_labels():
    args = build_parser().parse_args(["serve", "--prefill-labels", "a=b,c=d"])
    assert args.prefill_labels == {"a": "b", "c": "d"}
    assert args.max_pending == 1024
    assert build_parser().parse_args(["serve", "--max-pending", "8"]).max_pending == 8
    assert args.local_prefill_tokens == 0 and args.request_timeout is None
    assert build_parser().parse_args(["serve", "--request-timeout", "2.5"]).request_timeout == 2.5
    assert build_parser().parse_args(["serve", "--local-prefill-tokens", "64"]).local_prefill_tokens == 64
