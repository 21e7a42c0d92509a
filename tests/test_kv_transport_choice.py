"""The KV transport chosen for a prefill/decode pair, from where its workers run."""

from __future__ import annotations

import pytest

from services.kv_transport_choice import choose_kv_transport


@pytest.mark.parametrize("prefill, decode, same_node, nixl, expected", [
    ("cpu", "cpu", True, True, ("object_store", None)),
    ("cpu", "cpu", False, True, ("object_store", None)),
    ("cuda", "cpu", True, True, ("object_store", None)),
    ("cpu", "cuda:1", True, True, ("object_store", None)),
    ("cuda:0", "cuda:1", True, False, ("object_store", None)),
    ("cuda", "cuda", True, True, ("object_store", None)),
    ("cuda", "cuda", False, True, ("object_store", None)),
    ("cuda", "cuda", False, False, ("object_store", None)),
])
def test_auto_keeps_the_object_store_until_rdt_has_served_on_a_gpu(prefill, decode, same_node, nixl, expected):
    choice = choose_kv_transport("auto", prefill, decode, same_node, nixl)
    assert (choice.name, choice.tensor_transport) == expected


@pytest.mark.parametrize("same_node, nixl, expected", [
    (True, False, "cuda_ipc"), (True, True, "cuda_ipc"), (False, True, "nixl")])
def test_rdt_asked_for_gpu_workers(same_node, nixl, expected):
    choice = choose_kv_transport("rdt", "cuda:0", "cuda:1", same_node, nixl)
    assert (choice.name, choice.tensor_transport) == ("rdt", expected)


def test_object_store_when_asked_and_reasons():
    assert choose_kv_transport("object_store", "cuda", "cuda", True, True).name == "object_store"
    assert choose_kv_transport("auto", "cuda", "cuda", True, True).reason == (
        "RDT between GPUs has not yet served a request on a GPU here: --kv-transport rdt to use it")
    assert choose_kv_transport("auto", "cpu", "cuda", True, True).reason == (
        "one worker on the CPU and one on a GPU (its KV would have to cross to the host anyway)")
    assert choose_kv_transport("auto", "cpu", "cpu", True, True).reason == (
        "both workers on the CPU (the object store moves host memory as well)")


def test_rdt_asked_for_cpu_workers_goes_over_nixl_where_installed():
    """What tests the serving path's RDT wiring without a GPU: NIXL moves host memory over UCX."""
    for same_node in (True, False):
        choice = choose_kv_transport("rdt", "cpu", "cpu", same_node, True)
        assert (choice.name, choice.tensor_transport, choice.reason) == (
            "rdt", "nixl", "asked for, both workers on the CPU: NIXL over UCX")
    with pytest.raises(ValueError, match=r"kv transport rdt cannot be used: both workers on the CPU \(the object store "
                                         r"moves host memory as well\); rdt there needs NIXL, which is not installed"):
        choose_kv_transport("rdt", "cpu", "cpu", True, False)


def test_rdt_asked_where_it_cannot_work_is_an_error():
    with pytest.raises(ValueError, match="kv transport rdt cannot be used: one worker on the CPU and one on a GPU"):
        choose_kv_transport("rdt", "cpu", "cuda", True, True)
    with pytest.raises(ValueError, match="kv transport rdt cannot be used: one worker on the CPU and one on a GPU"):
        choose_kv_transport("rdt", "cuda:0", "cpu", False, True)
    with pytest.raises(ValueError, match="NIXL is not installed"):
        choose_kv_transport("rdt", "cuda", "cuda:1", False, False)
    assert choose_kv_transport("rdt", "cuda", "cuda:1", True, False).tensor_transport == "cuda_ipc"


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="kv transport must be one of auto, object_store, rdt, got 'nccl'"):
        choose_kv_transport("nccl", "cuda", "cuda", True, True)
    with pytest.raises(ValueError, match="decode device must be cpu, cuda or cuda:N, got 'gpu'"):
        choose_kv_transport("auto", "cuda", "gpu", True, True)
