"""The KV transport a deployment's workers use, resolved at launch from where they will run (no torch)."""

from __future__ import annotations

import importlib.util

import ray

from router.cluster_spec import ClusterSpec
from services.kv_transport_choice import KVTransportChoice, choose_kv_transport


def plan_kv_transport(spec: ClusterSpec, gpus_per_worker: float, local: bool) -> KVTransportChoice:
    """`choose_kv_transport` for `spec`'s prefill and decode workers: their devices (a GPU where
    they get a GPU share, unless their engine options name one), whether they share a host (a
    local Ray, or a cluster where one live node is all that can host either role), and whether NIXL
    is importable here (install it on every worker host too)."""
    if spec.mode == "colocated":
        return KVTransportChoice("object_store", None, "colocated: no KV hand-off")
    if spec.kv_transport == "object_store":
        return KVTransportChoice("object_store", None, "asked for")
    if max(spec.prefill_tensor_parallel_size, spec.decode_tensor_parallel_size) > 1:  # "rdt": ClusterSpec refuses
        return KVTransportChoice("object_store", None, "tensor-parallel workers hand over per-rank host slices")
    devices = [_device(spec.options_for(role).get("device", "auto"), gpus_per_worker) for role in ("prefill", "decode")]
    same_node = local or len(_host_nodes(spec, "prefill") | _host_nodes(spec, "decode")) == 1
    return choose_kv_transport(spec.kv_transport, *devices, same_node, importlib.util.find_spec("nixl") is not None)


def _device(configured: str, gpus_per_worker: float) -> str:
    if configured != "auto":
        return configured
    return "cuda" if gpus_per_worker > 0 else "cpu"  # Ray hides every GPU from a worker that asks for none


def _host_nodes(spec: ClusterSpec, role: str) -> set[str]:
    """The live nodes a worker of `role` may be placed on (by its labels, else its resource)."""
    labels = spec.labels(role)
    resource = spec.prefill_resource if role == "prefill" else spec.decode_resource
    return {node["NodeID"] for node in ray.nodes() if node["Alive"] and (
        labels.items() <= node.get("Labels", {}).items() if labels is not None
        else node["Resources"].get(resource, 0) > 0)}
