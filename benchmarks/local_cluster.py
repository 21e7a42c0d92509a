"""A pdserve cluster in one process, for the tests and the benchmarks: a simulated multi-node Ray
cluster, pdserve workers on it, and the router on a real uvicorn server over loopback (in a thread of
this process, which is the Ray driver). Installed with the package, so `benchmarks/` needs no `tests/`;
`tests/cluster_harness.py` re-exports it."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import ray
import uvicorn
from ray.cluster_utils import Cluster

from router.app import create_app
from router.launcher import ClusterSpec, build_router_state, start_workers, stop_workers
from router.loopback_port import free_port


def wait_for(condition, what: str, timeout: float = 15.0, interval: float = 0.1) -> None:
    """Until `condition()` holds; fails with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(interval)


def process_id(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10)


def wait_restarted(actor, old_pid: int, timeout: float) -> None:
    """Until `actor` answers from a process other than `old_pid`. A call sent just after the old
    process was killed can still reach it, so a ping that answers proves nothing."""
    def restarted() -> bool:
        try:
            return process_id(actor) != old_pid
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # still restarting
            return False

    wait_for(restarted, "the actor was not started again", timeout, 0.2)


def crash_and_restart(actor, timeout: float) -> None:
    """Kills `actor`'s process as a crash would and returns once Ray's restart of it answers."""
    old_pid = process_id(actor)
    ray.kill(actor, no_restart=False)
    wait_restarted(actor, old_pid, timeout)


def wait_healthy(process, url: str, timeout: float, what: str) -> None:
    """Until the server `process` (a Popen with its output piped) answers /health with 200."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} did not become healthy"
        time.sleep(0.5)


def set_step_delay(actors: list, seconds: float) -> None:
    """Pace the workers' engines: a sleep of `seconds` after every step (`EngineConfig.step_delay_s`),
    so that a long request is still running when a test acts on it, however fast the host."""
    ray.get([a.__ray_call__.remote(lambda self, v=seconds: setattr(self.engine.engine, "step_delay_s", v))
             for a in actors])


@contextlib.contextmanager
def step_delay(actors: list, seconds: float):
    """`set_step_delay` while the block runs."""
    set_step_delay(actors, seconds)
    try:
        yield
    finally:
        set_step_delay(actors, 0.0)


@contextlib.contextmanager
def two_node_cluster(num_prefill_slots: int = 2, num_decode_slots: int = 2):
    """Head (no roles), one node with `pd_prefill`, one with `pd_decode`: KV crosses nodes. The
    simulated nodes advertise no GPU (each would claim the host's own): on a GPU host, set
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 to have the workers use it anyway."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    prefill_node = cluster.add_node(num_cpus=1, num_gpus=0, resources={"pd_prefill": num_prefill_slots})
    decode_node = cluster.add_node(num_cpus=1, num_gpus=0, resources={"pd_decode": num_decode_slots})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="pdserve-test", logging_level="WARNING")
    try:
        yield cluster, prefill_node.node_id, decode_node.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextlib.contextmanager
def router_server(spec: ClusterSpec, model_name: str = "test-model", **router_options):
    """Start the spec's workers, serve the router on a free loopback port; yields (base_url, actors, state)."""
    actors = start_workers(spec, local=False)
    try:
        with serve_router(spec, model_name, **router_options) as (url, state):
            yield url, actors, state
    finally:
        stop_workers(actors)


@contextlib.contextmanager
def serve_router(spec: ClusterSpec, model_name: str = "test-model", **router_options):
    """A router for the workers of `spec` that already run, on a free loopback port; yields (base_url, state)."""
    state = build_router_state(spec, model_name, **router_options)
    with served_app(create_app(state)) as url:
        yield url, state


@contextlib.contextmanager
def served_app(app):
    """`app` on a real uvicorn over loopback, in a thread of this process; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the router did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
