"""The KV transport chosen for a prefill/decode pair, from where its workers run."""

from __future__ import annotations

import pytest

from services.kv_transport_choice import choose_kv_transport


@pytest.mark.parametrize("prefill, decode, same_node, nixl, expected", [
    ("cpu", "cpu", True, True, ("object_store", None)),
    ("cuda", "cpu", True, True, ("object_store", None)),
    ("cpu", "cuda:1", True, True, ("object_store", None)),
    ("cuda:0", "cuda:1", True, False, ("rdt", "cuda_ipc")),
    ("cuda", "cuda", True, True, ("rdt", "cuda_ipc")),
    ("cuda", "cuda", False, True, ("rdt", "nixl")),
    ("cuda", "cuda", False, False, ("object_store", None)),
])
def test_auto_uses_rdt_where_it_fits(prefill, decode, same_node, nixl, expected):
    choice = choose_kv_transport("auto", prefill, decode, same_node, nixl)
    assert (choice.name, choice.tensor_transport) == expected


def test_object_store_when_asked_and_reasons():
    assert choose_kv_transport("object_store", "cuda", "cuda", True, True).name == "object_store"
    assert "NIXL is not installed" in choose_kv_transport("auto", "cuda", "cuda", False, False).reason
    assert "a worker on the CPU" in choose_kv_transport("auto", "cpu", "cuda", True, True).reason


def test_rdt_asked_where_it_cannot_work_is_an_error():
    with pytest.raises(ValueError, match="kv transport rdt cannot be used: a worker on the CPU"):
        choose_kv_transport("rdt", "cpu", "cuda", True, True)
    with pytest.raises(ValueError, match="NIXL is not installed"):
        choose_kv_transport("rdt", "cuda", "cuda:1", False, False)
    assert choose_kv_transport("rdt", "cuda", "cuda:1", True, False).tensor_transport == "cuda_ipc"


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="kv transport must be one of auto, object_store, rdt, got 'nccl'"):
        choose_kv_transport("nccl", "cuda", "cuda", True, True)
    with pytest.raises(ValueError, match="decode device must be cpu, cuda or cuda:N, got 'gpu'"):
        choose_kv_transport("auto", "cuda", "gpu", True, True)
