"""Which KV transport a prefill/decode pair can use, from where its workers run (imports no torch).

Ray Direct Transport (RDT, Ray 2.60, alpha) keeps a tensor in its producer's memory and moves it
straight to the consumer. Its transports differ in who may pass the reference, and that decides
which ones fit pdserve, where a router (any of several processes) receives the prefill's KV
reference and hands it to a decode worker inside a list (`KVTransport.handle`):
- "cuda_ipc" and "nixl" are one-sided: a reference the producer itself put with
  `ray.put(value, _tensor_transport=...)` carries its transport metadata at once, so it may be
  passed on (nested in a list) and fetched with `ray.get` from any process. (A reference RETURNED
  by a `tensor_transport` task may not: its metadata reaches the caller asynchronously and Ray
  refuses to pass it on before, Ray issue #59644.) They fit: CUDA IPC between workers on one host's
  GPUs, NIXL (RDMA / UCX, `pip install nixl`) across hosts — and, asked for explicitly, between
  CPU workers (host memory over UCX), which is how the wiring is tested without a GPU.
- "nccl" and "gloo" are two-sided collectives: only the process that created the collective group
  may submit the tasks that return and pass the references, each actor is in one group per backend,
  references pass only as direct arguments, and async actors are not supported. pdserve's workers
  are async actors called by several router processes, so these do not fit.
And for every RDT transport: `await` on an RDT reference is not supported (fetch on a thread).
"""

from __future__ import annotations

from dataclasses import dataclass

KV_TRANSPORT_MODES = ("auto", "object_store", "rdt")


@dataclass(frozen=True)
class KVTransportChoice:
    name: str  # a key of services.kv_transport.TRANSPORTS: "object_store" or "rdt"
    tensor_transport: str | None  # RDT's transport ("cuda_ipc", "nixl"); None for the object store
    reason: str


def choose_kv_transport(mode: str, prefill_device: str, decode_device: str, same_node: bool,
                        nixl_installed: bool) -> KVTransportChoice:
    """The transport for KV from a prefill worker on `prefill_device` to a decode worker on
    `decode_device` ("cpu", "cuda", "cuda:N"). mode "auto": the object store — for CPU workers
    because it moves host memory as well (and needs no NIXL), for GPU workers until RDT has served
    on a GPU (its wiring is tested on CPUs through NIXL; CUDA IPC itself has not run); "rdt": RDT or
    a ValueError saying why not (NIXL when both workers are on the CPU); "object_store": always."""
    if mode not in KV_TRANSPORT_MODES:
        raise ValueError(f"kv transport must be one of {', '.join(KV_TRANSPORT_MODES)}, got {mode!r}")
    for role, device in (("prefill", prefill_device), ("decode", decode_device)):
        if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
            raise ValueError(f"{role} device must be cpu, cuda or cuda:N, got {device!r}")
    if mode == "object_store":
        return KVTransportChoice("object_store", None, "asked for")
    why_not = None
    if prefill_device == decode_device == "cpu":
        if mode == "rdt" and nixl_installed:
            return KVTransportChoice("rdt", "nixl", "asked for, both workers on the CPU: NIXL over UCX")
        why_not = "both workers on the CPU (the object store moves host memory as well)" + (
            "" if nixl_installed else "; rdt there needs NIXL, which is not installed (pip install nixl)")
    elif "cpu" in (prefill_device, decode_device):
        why_not = "one worker on the CPU and one on a GPU (its KV would have to cross to the host anyway)"
    elif mode == "auto":  # until a GPU run has served over it (docs/gpu.md: the command that checks it)
        why_not = "RDT between GPUs has not yet served a request on a GPU here: --kv-transport rdt to use it"
    elif same_node:
        return KVTransportChoice("rdt", "cuda_ipc", "both workers on one host's GPUs: CUDA IPC")
    elif nixl_installed:
        return KVTransportChoice("rdt", "nixl", "GPUs on different hosts: NIXL")
    else:
        why_not = "GPUs on different hosts and NIXL is not installed (pip install nixl)"
    if mode == "rdt":
        raise ValueError(f"kv transport rdt cannot be used: {why_not}")
    return KVTransportChoice("object_store", None, why_not)
