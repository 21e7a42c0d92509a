"""Topology validation, label placement and CLI flag validation (on a small simulated cluster)."""

from __future__ import annotations

import os

import pytest
import ray
from ray.cluster_utils import Cluster

from router.cli import build_parser
from router.launcher import ClusterSpec, start_workers, stop_workers, validate_topology


@pytest.fixture(scope="module")
def labelled_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    prefill = cluster.add_node(num_cpus=1, num_gpus=0, labels={"pdserve/role": "prefill"})
    decode = cluster.add_node(num_cpus=1, num_gpus=0, labels={"pdserve/role": "decode"})
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


def test_more_gpus_than_the_cluster_has_fail_fast(labelled_cluster, tiny_path):
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-launcher", gpus_per_worker=0.5,
                       prefill_labels={"pdserve/role": "prefill"}, decode_labels={"pdserve/role": "decode"})
    with pytest.raises(RuntimeError, match=r"the workers ask for 1 GPU\(s\) in all but the cluster has 0"):
        validate_topology(spec)


@pytest.mark.parametrize(("workers", "cluster_gpus", "local", "share"), [
    (2, 0, True, 0.0), (2, 0, False, 0.0),  # no GPU: none asked (Ray would refuse to place them)
    (2, 4, False, 1.0), (5, 1, False, 1.0),  # a cluster: one GPU each (its nodes carry them)
    (2, 1, True, 0.5), (3, 2, True, 0.5), (5, 2, True, 1 / 3), (2, 4, True, 1.0),  # one host: shared
])
def test_gpu_share_of_each_worker(workers, cluster_gpus, local, share):
    spec = ClusterSpec(model="x", mode="colocated", num_colocated=workers)
    assert spec.worker_gpus(cluster_gpus, local) == share


def test_a_given_gpu_share_is_used_as_is_and_checked():
    assert [ClusterSpec(model="x", gpus_per_worker=0.25).worker_gpus(g, local) for g, local in
            ((0, True), (1, True), (8, False))] == [0.25, 0.25, 0.25]
    for bad in (2, -0.5):
        with pytest.raises(ValueError, match=r"gpus_per_worker must be in \[0, 1\]"):
            ClusterSpec(model="x", gpus_per_worker=bad)


def test_label_selectors_place_each_role_on_its_node(labelled_cluster, tiny_path):
    prefill_node, decode_node = labelled_cluster
    spec = ClusterSpec(model=str(tiny_path), namespace="pd-launcher", prefill_labels={"pdserve/role": "prefill"},
                       decode_labels={"pdserve/role": "decode"}, engine_options={"num_threads": 1})
    actors = start_workers(spec, local=False)
    try:
        stats = [ray.get(a.stats.remote()) for a in actors]
        assert [s.node_id for s in stats] == [prefill_node, decode_node]
        if not os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):  # (gpu_check.sh sets it)
            # No GPU in this cluster, so none asked for: Ray hides the host's GPUs from the workers.
            assert [s.device for s in stats] == ["cpu", "cpu"]
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
    ["serve", "--local-prefill-tokens", "some"], ["serve", "--gpus-per-worker", "2"], ["serve", "--gpus-per-worker", "-0.5"], ["serve", "--gpus-per-worker", "x"],
    ["serve", "--startup-timeout", "0"], ["serve", "--startup-timeout", "soon"],
])
def test_cli_refuses_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_router_flags_are_shared_by_serve_and_router():
    for command in ("serve", "router"):
        args = build_parser().parse_args([command, "--port", "9000", "--max-pending", "5", "--request-timeout", "3",
                                          "--local-prefill-tokens", "auto", "--served-model-name", "m"])
        assert (args.port, args.max_pending, args.request_timeout, args.local_prefill_tokens,
                args.served_model_name, args.host) == (9000, 5, 3.0, None, "m", "127.0.0.1")
    args = build_parser().parse_args(["router"])
    assert (args.address, args.namespace, args.model, args.wait) == ("auto", "pdserve", None, 60.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--wait", "-1"])


def test_cli_parses_labels():
    args = build_parser().parse_args(["serve", "--prefill-labels", "a=b,c=d"])
    assert args.prefill_labels == {"a": "b", "c": "d"}
    assert args.max_pending == 1024
    assert build_parser().parse_args(["serve", "--max-pending", "8"]).max_pending == 8
    assert args.local_prefill_tokens == 0 and args.request_timeout is None
    assert build_parser().parse_args(["serve", "--request-timeout", "2.5"]).request_timeout == 2.5
    assert build_parser().parse_args(["serve", "--local-prefill-tokens", "64"]).local_prefill_tokens == 64
    assert build_parser().parse_args(["serve", "--local-prefill-tokens", "auto"]).local_prefill_tokens is None
    assert args.gpus_per_worker is None and build_parser().parse_args(["serve", "--gpus-per-worker", "auto"]).gpus_per_worker is None
    assert build_parser().parse_args(["serve", "--gpus-per-worker", "0.5"]).gpus_per_worker == 0.5


def test_serve_gives_its_workers_the_startup_timeout(monkeypatch, tiny_path):
    import router.launcher

    started = {}
    monkeypatch.setattr(router.launcher, "serve", lambda spec, *args, **kwargs: started.update(spec=spec))
    for argv, timeout in ((["serve"], 600.0), (["serve", "--startup-timeout", "45"], 45.0)):
        args = build_parser().parse_args([*argv, "--model", str(tiny_path)])
        args.run(args)
        assert started.pop("spec").startup_timeout == timeout


def test_cli_quantization_per_role(tiny_path):
    args = build_parser().parse_args(["serve", "--model", str(tiny_path), "--quantization", "int8",
                                      "--prefill-quantization", "none", "--kernels", "torch"])
    assert (args.quantization, args.prefill_quantization, args.decode_quantization, args.kernels) == (
        "int8", "none", None, "torch")
    spec = ClusterSpec(model=str(tiny_path), engine_options={"quantization": "int8"},
                       role_engine_options={"prefill": {"quantization": None}})
    assert spec.options_for("prefill") == {"quantization": None}
    assert spec.options_for("decode") == {"quantization": "int8"}
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, w8a8, w4a8 or None"):
        ClusterSpec(model=str(tiny_path), role_engine_options={"decode": {"quantization": "int2"}})


def test_the_shutdown_lookup_gives_up_on_a_stuck_or_failing_control_store(monkeypatch):
    # `pdserve serve --address` stops every named worker it finds; a control store that hangs or fails must
    # neither hold the shutdown nor fail it
    import threading

    from router import launcher, worker_pool

    never = threading.Event()
    monkeypatch.setattr(worker_pool, "named_workers", lambda namespace: {"decode-0": "actor"})
    assert launcher._all_workers("ns", timeout=5) == ["actor"]
    monkeypatch.setattr(worker_pool, "named_workers", lambda namespace: never.wait())
    assert launcher._all_workers("ns", timeout=0.2) == []
    monkeypatch.setattr(worker_pool, "named_workers", lambda namespace: 1 / 0)
    assert launcher._all_workers("ns", timeout=5) == []
    never.set()
