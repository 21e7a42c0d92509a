"""Workers on a GPU host get a share of the GPU and run their engines on it (needs CUDA; skipped
without). Ray hides every GPU from an actor that asks for none, so this is what puts prefill and
decode on the GPU at all: `pdserve serve` on one host with one GPU gives each worker half of it."""

from __future__ import annotations

import e2e_checks as checks
import pytest
import ray
import torch
from cluster_harness import serve_router

from router.launcher import ClusterSpec, start_workers, stop_workers
from router.ray_instance import init_local_ray
from services.tokenizer import Tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs one CUDA device")]


@pytest.fixture(scope="module")
def local_gpu_cluster(tiny_path):
    with pytest.MonkeyPatch.context() as env:
        # The switch that lets an actor see GPUs it did not ask for: off, or this test proves nothing.
        env.delenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", raising=False)
        # KV over RDT (CUDA IPC), asked for: `auto` keeps the object store until this has passed on a GPU
        spec = ClusterSpec(model=str(tiny_path), namespace="pd-gpu", engine_options={"max_num_seqs": 32},
                           kv_transport="rdt")
        init_local_ray(spec, num_cpus=2)
        try:
            actors = start_workers(spec, local=True)
            try:
                yield spec, actors
            finally:
                stop_workers(actors)
        finally:
            ray.shutdown()


def test_each_worker_takes_half_the_gpu_and_runs_on_it(local_gpu_cluster):
    spec, actors = local_gpu_cluster
    assert ray.cluster_resources()["GPU"] == 1 and spec.worker_gpus(1, local=True) == 0.5
    assert [ray.get(a.worker_spec.remote()).placement["num_gpus"] for a in actors] == [0.5, 0.5]
    assert [ray.get(a.stats.remote()).device for a in actors] == ["cuda:0", "cuda:0"]


def test_gpu_workers_on_one_host_hand_kv_over_cuda_ipc(local_gpu_cluster):
    """`--kv-transport rdt` on one host's GPU: Ray Direct Transport over CUDA IPC (the greedy test
    below then runs the serving path over it)."""
    _, actors = local_gpu_cluster
    specs = [ray.get(a.worker_spec.remote()) for a in actors]
    assert [(s.kv_transport, s.tensor_transport) for s in specs] == [("rdt", "cuda_ipc")] * 2


def test_greedy_through_gpu_workers_equals_the_engine(local_gpu_cluster, tiny_path):
    spec, _ = local_gpu_cluster
    with serve_router(spec) as (url, _):
        checks.check_greedy_matches_engine(url, str(tiny_path), checks.prompts(3, 500),
                                           Tokenizer.from_folder(tiny_path))
