"""DeviceKV (KV checked on its device) and KVStage, and the KV moved over Ray Direct Transport with
the gloo transport between two async actors, as CPU tensors (the GPU transports run in gpu_check)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import ray
import torch
from ray.experimental.collective import create_collective_group

from services.device_kv import DeviceKV, KVStage, device_checksum
from services.engine import Engine
from services.errors import KVTransferError
from services.sampling_params import SamplingParams
from services.scheduler import SampledToken


def kv_of(dtype: torch.dtype, num_tokens: int = 37, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 2, num_tokens, 2, 16, generator=gen).to(dtype)  # [L, 2, T, K, Dh] of the tiny preset


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checksum_catches_a_flipped_bit_and_a_swap(dtype):
    kv = kv_of(dtype)
    sent = DeviceKV.of(kv)
    sent.verify(4, 2, 16, str(dtype).removeprefix("torch."))
    flipped = kv.clone()
    flipped.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).view(-1)[1234] ^= 1
    with pytest.raises(KVTransferError, match="KV checksum mismatch"):
        DeviceKV(flipped, sent.checksum).verify(4, 2, 16, str(dtype).removeprefix("torch."))
    swapped = kv.clone().view(-1)
    swapped[[10, 11]] = swapped[[11, 10]]
    assert int(device_checksum(swapped.view(kv.shape))) != int(sent.checksum)


def test_checksum_spans_chunks(monkeypatch):
    monkeypatch.setattr("services.device_kv._CHUNK", 1000)  # 9,472 elements in 10 chunks
    kv = kv_of(torch.float32)
    sent = device_checksum(kv)
    for index in (999, 1000, 9_471):  # either side of a chunk's edge, and the short last chunk
        changed = kv.clone()
        changed.view(torch.int32).view(-1)[index] ^= 1 << 31  # the sign bit
        assert int(device_checksum(changed)) != int(sent)
    moved = kv.clone().view(-1)
    moved[[5, 1005]] = moved[[1005, 5]]  # the same offset in two chunks, swapped
    assert int(device_checksum(moved.view(kv.shape))) != int(sent)


def test_layout_mismatch_is_named():
    with pytest.raises(KVTransferError, match=r"KV of shape \(4, 2, 37, 2, 16\) bfloat16 does not fit a pool of "
                                              r"4 layers, 4 kv heads of 16, bfloat16"):
        DeviceKV.of(kv_of(torch.bfloat16)).verify(4, 4, 16, "bfloat16")
    with pytest.raises(KVTransferError, match="bfloat16 does not fit a pool of 4 layers, 2 kv heads of 16, float32"):
        DeviceKV.of(kv_of(torch.bfloat16)).check_layout(4, 2, 16, "float32")


def test_copy_into_writes_the_slots():
    kv = kv_of(torch.float32, num_tokens=3)
    pool = torch.zeros(4, 2, 10, 2, 16)
    DeviceKV.of(kv).copy_into(pool, torch.tensor([7, 2, 5]))
    assert torch.equal(pool[:, :, [7, 2, 5]], kv) and int(pool[:, :, [0, 1, 3, 4, 6, 8, 9]].count_nonzero()) == 0


def test_stage_hands_each_kv_out_once_within_its_lease():
    now = [100.0]
    stage = KVStage(lease_s=5.0, clock=lambda: now[0])
    stage.put("a", DeviceKV.of(kv_of(torch.float32, 2)))
    stage.put("b", DeviceKV.of(kv_of(torch.float32, 3)))
    assert stage.take("a").num_tokens == 2 and len(stage) == 1
    with pytest.raises(KVTransferError, match="no staged KV for request 'a'"):
        stage.take("a")
    now[0] = 105.0
    assert stage.expire() == ["b"] and len(stage) == 0


def test_engine_handoff_on_the_device_continues_exactly(tiny_path):
    """Prefill exports a DeviceKV (no host copy), a second engine imports it and decodes on: the same
    tokens as one uninterrupted run; a corrupted one fails at admission, naming the checksum."""
    prompt, params = list(range(5, 42)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = Engine(model=tiny_path).generate([prompt], params)[0].token_ids
    prefill = Engine(model=tiny_path)
    prefill.runner.export_on_device = True
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), export_kv=True)
    (out,) = prefill.step()
    assert isinstance(out.kv, DeviceKV) and out.kv.num_tokens == len(prompt)
    decode = Engine(model=tiny_path)
    first = SampledToken(out.new_token_ids[0], None)
    decode.add_prefilled("r", prompt, first, params, out.kv)
    tokens = list(out.new_token_ids)
    while decode.has_unfinished_requests:
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == whole
    with torch.inference_mode():  # the engine made it an inference tensor
        out.kv.kv.view(-1)[3] += 1.0
    with pytest.raises(KVTransferError, match="KV checksum mismatch"):
        Engine(model=tiny_path).add_prefilled("r", prompt, first, params, out.kv)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Producer:
    """Stands in for a prefill worker: an async actor that stages KV and hands it out over RDT."""

    def __init__(self) -> None:
        self.stage = KVStage()

    async def export(self, request_id: str, seed: int) -> int:
        kv = DeviceKV.of(kv_of(torch.bfloat16, seed=seed))
        self.stage.put(request_id, kv)
        return int(kv.checksum)

    @ray.method(tensor_transport="gloo")
    def take(self, request_id: str, corrupt: bool = False) -> DeviceKV:
        kv = self.stage.take(request_id)
        if corrupt:  # after the checksum: what a bad transfer would deliver
            kv.kv.view(torch.int16).view(-1)[0] ^= 1
        return kv

    async def num_staged(self) -> int:
        return len(self.stage)

    async def share(self, request_id: str) -> list[ray.ObjectRef]:
        """The KV put by this actor, its owner, under a one-sided transport (NIXL; CUDA IPC on a
        GPU): a ref that may be passed on nested in a list, which a task's RDT return may not be."""
        return [ray.put(self.stage.take(request_id), _tensor_transport="nixl")]


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Consumer:
    """Stands in for a decode worker: verifies what arrives and writes it into its pool."""

    def __init__(self) -> None:
        self.pool = torch.zeros(4, 2, 64, 2, 16, dtype=torch.bfloat16)

    async def admit(self, kv: DeviceKV) -> tuple[int, int, bool]:
        kv.verify(4, 2, 16, "bfloat16")
        kv.copy_into(self.pool, torch.arange(kv.num_tokens))
        return kv.num_tokens, int(kv.checksum), torch.equal(self.pool[:, :, : kv.num_tokens], kv.kv)

    async def admit_shared(self, refs: list[ray.ObjectRef]) -> tuple[int, int, bool]:
        return await self.admit(ray.get(refs[0], timeout=60))  # RDT refs cannot be awaited


@pytest.fixture(scope="module")
def actors():
    here = str(Path(__file__).parent)  # the actors' classes are this module's: the workers import it
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", namespace="pdserve-device-kv-test",
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}})
    try:
        producer, consumer = Producer.remote(), Consumer.remote()
        create_collective_group([producer, consumer], backend="torch_gloo")
        yield producer, consumer
    finally:
        ray.shutdown()


def test_kv_moves_over_rdt_gloo_and_verifies(actors):
    producer, consumer = actors
    sent = ray.get(producer.export.remote("r1", 3))
    ref = producer.take.remote("r1")
    num_tokens, checksum, landed = ray.get(consumer.admit.remote(ref), timeout=60)
    assert (num_tokens, checksum, landed) == (37, sent, True)
    assert ray.get(producer.num_staged.remote()) == 0  # the stage let go once it was taken
    with pytest.raises(ValueError, match="two-sided transport"):  # it is an RDT object, not in the store
        ray.get(ref, timeout=60)


def test_corrupt_rdt_kv_fails_its_check(actors):
    producer, consumer = actors
    ray.get(producer.export.remote("r2", 4))
    with pytest.raises(KVTransferError, match="KV checksum mismatch"):
        ray.get(consumer.admit.remote(producer.take.remote("r2", corrupt=True)), timeout=60)
    with pytest.raises(KVTransferError, match="no staged KV for request 'r2'"):  # taken once only
        ray.get(consumer.admit.remote(producer.take.remote("r2")), timeout=60)


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                    reason="NIXL not installed (pip install --no-deps nixl nixl-cu12: runs on CPU through UCX)")
def test_kv_put_by_its_owner_passes_through_a_third_process_over_nixl(actors):
    """The router's hop: the prefill worker puts the KV, the router holds the ref and passes it on
    inside a list, the decode worker fetches it. (On an H100 a ref returned by a cuda_ipc task failed
    exactly this: "Tensor transport metadata is not available ... at the time of borrowing".)"""
    producer, consumer = actors
    sent = ray.get(producer.export.remote("r3", 5))
    refs = ray.get(producer.share.remote("r3"), timeout=60)  # the router now borrows the ref
    assert ray.get(consumer.admit_shared.remote(refs), timeout=60) == (37, sent, True)
    ray.get(producer.export.remote("r4", 6))
    nested = producer.share.remote("r4")  # or resolved by the decode worker itself
    assert ray.get(consumer.admit_shared.remote(nested), timeout=60)[2]
    assert ray.get(producer.num_staged.remote()) == 0
