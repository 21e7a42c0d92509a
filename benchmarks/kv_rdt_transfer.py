"""KV hand-off over Ray Direct Transport (device to device) against the object store, one host.

Method. A producer actor stages a `DeviceKV` of the preset's shape for `--tokens` tokens (1b:
16 layers x 2 x T x 8 kv heads x 64, bf16: 32 MiB for 1,024 tokens) on its device, checksummed
there; the driver (standing in for the router) asks it for the KV with `take`, called with
`.options(tensor_transport=...)`, and hands the reference to a consumer actor:
- one-sided transports (cuda_ipc, nixl: pdserve's design): the producer itself puts the KV with
  `ray.put(kv, _tensor_transport=...)` and returns `[ref]`, which reaches the consumer nested in a
  list; the consumer fetches it with `ray.get` (RDT does not support `await` on its refs). (A ref
  returned by a `tensor_transport` task cannot be borrowed like this: its transport metadata reaches
  its owner, the caller, asynchronously, and Ray 2.60 refuses to pass it on before — on an H100 with
  cuda_ipc it failed every time, Ray issue #59644. `ray.put` computes the metadata at once);
- two-sided ones (nccl, gloo) as a direct argument (only the group's creator may pass them).
The consumer verifies the checksum on its device and copies the KV into a preallocated pool
[L, 2, S, K, Dh] at scattered slots. Reported per trial: the driver's wall time from `take` to the
consumer's answer, and the consumer's own parts (fetch, verify, copy). Baselines in the same run:
the object store (`take` without tensor_transport: the KV is copied to the host and back) and
a device copy of the same bytes within the consumer. With a GPU each actor gets half of it
(`num_gpus=0.5`: workers sharing one GPU, as benchmarks/gpu_check.sh runs them).

Goal (issue 15): >= 20 GB/s GPU to GPU on one host for a 1,024-token 1b KV.

    python -m benchmarks.kv_rdt_transfer --transport cuda_ipc [--tokens 1024 4096] [--trials 10]
    python -m benchmarks.kv_rdt_transfer --transport gloo --device cpu   # the CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

from benchmarks.report import environment, format_table, write_results
from services.device_kv import DeviceKV, KVStage
from services.model_presets import PRESETS

ONE_SIDED = ("cuda_ipc", "nixl")


@ray.remote(enable_tensor_transport=True)
class Producer:
    def __init__(self, device: str) -> None:
        self.device, self.stage = device, KVStage()

    def export(self, request_id: str, shape: tuple[int, ...]) -> int:
        kv = torch.randn(*shape, device=self.device).to(torch.bfloat16)
        self.stage.put(request_id, DeviceKV.of(kv))
        return kv.numel() * kv.element_size()

    def take(self, request_id: str) -> DeviceKV:
        kv = self.stage.take(request_id)
        if self.device != "cpu":
            torch.cuda.synchronize()  # the checksum is computed before anyone reads the tensor
        return kv

    def share(self, request_id: str, transport: str) -> list[ray.ObjectRef]:
        """The KV put by its owner under a one-sided transport; the ref can be passed on from here."""
        return [ray.put(self.take(request_id), _tensor_transport=transport)]


@ray.remote(enable_tensor_transport=True)
class Consumer:
    def __init__(self, device: str, shape: tuple[int, ...]) -> None:
        layers, two, tokens, heads, dim = shape
        self.device = device
        self.pool = torch.zeros(layers, two, 4 * tokens, heads, dim, dtype=torch.bfloat16, device=device)
        self.slots = torch.randperm(4 * tokens, device=device)[:tokens]

    def _sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()

    def admit(self, kv: DeviceKV | list, fetched_at: float | None = None) -> dict[str, float]:
        start = time.perf_counter()
        if isinstance(kv, list):  # a borrowed one-sided reference: fetched here
            kv = ray.get(kv[0])
        fetched = time.perf_counter()
        kv.verify(self.pool.shape[0], self.pool.shape[3], self.pool.shape[4], "bfloat16")
        verified = time.perf_counter()
        kv.copy_into(self.pool, self.slots)
        self._sync()
        return {"fetch_s": fetched - start, "verify_s": verified - fetched, "copy_s": time.perf_counter() - verified}

    def device_copy(self, shape: tuple[int, ...], repeats: int = 5) -> float:
        source = torch.randn(*shape, device=self.device).to(torch.bfloat16)
        best = float("inf")
        for _ in range(repeats):
            self._sync()
            start = time.perf_counter()
            self.pool.index_copy_(2, self.slots, source)
            self._sync()
            best = min(best, time.perf_counter() - start)
        return best


def trial(producer, consumer, transport: str | None, shape: tuple[int, ...], request_id: str) -> dict[str, float]:
    ray.get(producer.export.remote(request_id, shape))
    start = time.perf_counter()
    if transport in ONE_SIDED:  # the consumer receives the list: the ref inside it is fetched there
        parts = ray.get(consumer.admit.remote(producer.share.remote(request_id, transport)))
    else:
        take = producer.take if transport is None else producer.take.options(tensor_transport=transport)
        parts = ray.get(consumer.admit.remote(take.remote(request_id)))
    return {"total_s": time.perf_counter() - start, **parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", default="cuda_ipc", choices=("cuda_ipc", "nixl", "nccl", "gloo"))
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    p = PRESETS[args.preset]
    gpus = 0.5 if device == "cuda" else 0
    ray.init(num_cpus=2, num_gpus=1 if device == "cuda" else 0, include_dashboard=False, logging_level="WARNING")
    rows, results = [], []
    try:
        for tokens in args.tokens:
            shape = (p.num_layers, 2, tokens, p.num_kv_heads, p.hidden_size // p.num_heads)
            producer = Producer.options(num_gpus=gpus, num_cpus=0).remote(device)
            consumer = Consumer.options(num_gpus=gpus, num_cpus=0).remote(device, shape)
            if args.transport in ("nccl", "gloo"):
                from ray.experimental.collective import create_collective_group
                create_collective_group([producer, consumer], backend="torch_gloo" if args.transport == "gloo" else "nccl")
            nbytes = ray.get(producer.export.remote("warm", shape))
            copy_s = ray.get(consumer.device_copy.remote(shape))
            for transport in (args.transport, None):
                trial(producer, consumer, transport, shape, "warm-up")  # first calls set up transports
                runs = [trial(producer, consumer, transport, shape, f"r{i}") for i in range(args.trials)]
                median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                name = transport or "object_store"
                rows.append([name, tokens, nbytes / 2**20, median["total_s"] * 1e3, nbytes / median["total_s"] / 1e9,
                             median["fetch_s"] * 1e3, median["verify_s"] * 1e3, median["copy_s"] * 1e3, copy_s * 1e3])
                results.append({"transport": name, "tokens": tokens, "bytes": nbytes, "median": median,
                                "best_total_s": min(r["total_s"] for r in runs), "device_copy_s": copy_s})
            ray.kill(producer)
            ray.kill(consumer)
    finally:
        ray.shutdown()
    print(format_table(["transport", "tokens", "MiB", "total ms", "GB/s", "fetch ms", "verify ms", "copy ms",
                        "device copy ms"], rows))
    print(write_results(f"kv_rdt_transfer_{args.transport}",
                        {"environment": environment(), "device": device, "preset": args.preset, "results": results}))


if __name__ == "__main__":
    main()
