"""The KV transport `pdserve serve` resolves for a deployment, and the flag that asks for one."""

from __future__ import annotations

import importlib.util

import pytest

from router.cli import build_parser
from router.cluster_spec import ClusterSpec
from router.kv_transport_plan import plan_kv_transport

NIXL = importlib.util.find_spec("nixl") is not None


def test_the_flag_defaults_to_auto_and_reaches_the_spec(monkeypatch, tiny_path):
    import router.launcher

    started = {}
    monkeypatch.setattr(router.launcher, "serve", lambda spec, *args, **kwargs: started.update(spec=spec))
    for argv, mode in (([], "auto"), (["--kv-transport", "rdt"], "rdt"), (["--kv-transport", "object_store"],
                                                                            "object_store")):
        args = build_parser().parse_args(["serve", "--model", str(tiny_path), *argv])
        args.run(args)
        assert started.pop("spec").kv_transport == mode


def test_the_flag_refuses_other_transports(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--kv-transport", "nccl"])
    assert exit_info.value.code == 2
    assert "argument --kv-transport: invalid choice: 'nccl'" in capsys.readouterr().err


def test_the_spec_refuses_rdt_where_no_kv_moves_over_it():
    with pytest.raises(ValueError, match="kv_transport must be one of auto, object_store, rdt, got 'gloo'"):
        ClusterSpec(model="x", kv_transport="gloo")
    with pytest.raises(ValueError, match="kv_transport rdt needs mode disaggregated"):
        ClusterSpec(model="x", mode="colocated", kv_transport="rdt")
    with pytest.raises(ValueError, match="kv_transport rdt cannot be used with tensor-parallel workers"):
        ClusterSpec(model="x", decode_tensor_parallel_size=2, kv_transport="rdt")


def test_cpu_workers_get_the_object_store_unless_rdt_is_asked_for():
    assert plan_kv_transport(ClusterSpec(model="x"), 0.0, local=True).name == "object_store"
    if NIXL:
        choice = plan_kv_transport(ClusterSpec(model="x", kv_transport="rdt"), 0.0, local=True)
        assert (choice.name, choice.tensor_transport) == ("rdt", "nixl")
    else:
        with pytest.raises(ValueError, match="NIXL, which is not installed"):
            plan_kv_transport(ClusterSpec(model="x", kv_transport="rdt"), 0.0, local=True)


def test_gpu_workers_on_one_host_get_cuda_ipc_and_the_rest_the_object_store():
    choice = plan_kv_transport(ClusterSpec(model="x", kv_transport="rdt"), 0.5, local=True)  # half a GPU each, one host
    assert (choice.name, choice.tensor_transport) == ("rdt", "cuda_ipc")
    assert plan_kv_transport(ClusterSpec(model="x"), 0.5, local=True).name == "object_store"  # auto: until verified
    # Engine options naming the CPU win over a GPU share.
    cpu = ClusterSpec(model="x", role_engine_options={"decode": {"device": "cpu"}})
    assert plan_kv_transport(cpu, 0.5, local=True).name == "object_store"
    assert plan_kv_transport(ClusterSpec(model="x", kv_transport="object_store"), 0.5, local=True).reason == "asked for"
    colocated = plan_kv_transport(ClusterSpec(model="x", mode="colocated"), 0.5, local=True)
    assert (colocated.name, colocated.reason) == ("object_store", "colocated: no KV hand-off")
    tensor_parallel = plan_kv_transport(ClusterSpec(model="x", prefill_tensor_parallel_size=2), 1.0, local=True)
    assert tensor_parallel.name == "object_store"
