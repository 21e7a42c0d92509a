"""`pdserve chaos`'s cluster: a simulated multi-node Ray cluster on this host (Ray token
authentication on), two prefill and two decode workers, and router processes on loopback, with the
faults it can suffer: a worker crash, a router crash, a node removed.

A worker crashes from inside (`os._exit` run in the worker by a Ray call: no HTTP route reaches it)
and Ray starts it again; a router is a `pdserve router` process killed with SIGKILL and started
again on its port; a removed node takes its workers with it, Ray starts them on the other node, and
a fresh node takes the removed one's place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import ray

from router.launcher import ClusterSpec, start_workers, stop_workers
from router.worker_pool import named_workers

ROLE_SLOTS = {"pd_prefill": 2, "pd_decode": 2}  # per node: either node can hold every worker


class ChaosCluster:
    def __init__(self, model: str, namespace: str, ports: list[int], engine_options: dict) -> None:
        from ray.cluster_utils import Cluster

        self.namespace = namespace
        self.cluster = Cluster(initialize_head=True,
                               head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
        self.nodes = [self._add_node() for _ in range(2)]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=namespace, logging_level="WARNING")
        self.spec = ClusterSpec(model=model, num_prefill=2, num_decode=2, namespace=namespace,
                                engine_options=engine_options, pin_cpus=False, max_restarts=1000,
                                peak_flops=1e12, peak_bytes_per_second=1e10, startup_timeout=300)
        self.actors = start_workers(self.spec, local=False)
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self.routers: list[subprocess.Popen | None] = [self._start_router(port) for port in ports]
        for i in range(len(ports)):
            self.wait_router(i, timeout=300)

    def _add_node(self):
        return self.cluster.add_node(num_cpus=1, num_gpus=0, resources=dict(ROLE_SLOTS))

    def _start_router(self, port: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "router.cli", "router", "--address", self.cluster.address,
                   "--namespace", self.namespace, "--host", "127.0.0.1", "--port", str(port), "--wait", "120",
                   "--request-timeout", "120"]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    # -- faults -----------------------------------------------------------------------------------

    def crash_workers(self, role: str, every: bool = False) -> str:
        """Crash the first worker of `role` (or `every` one) from inside; Ray starts each again.
        Returns their names."""
        names = sorted(n for n in named_workers(self.namespace) if n.startswith(role + "-"))
        for name in names if every else names[:1]:
            ray.get_actor(name, namespace=self.namespace).__ray_call__.remote(lambda self: os._exit(1))
        return ",".join(names if every else names[:1])

    def crash_router(self, index: int) -> None:
        router = self.routers[index]
        os.killpg(router.pid, signal.SIGKILL)
        router.wait()
        self.routers[index] = self._start_router(int(self.urls[index].rsplit(":", 1)[1]))

    def remove_node(self) -> str:
        """Remove the role node that holds the most workers (`replace_node` adds a fresh one)."""
        hosts = [ray.get(a.stats.remote("chaos"), timeout=60).node_id for a in self._live_actors()]
        node = max(self.nodes, key=lambda n: hosts.count(n.node_id))
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        return node.node_id[:12]

    def replace_node(self) -> None:
        """A fresh role node in the removed one's place (from the main thread: Ray sets a signal handler)."""
        self.nodes.append(self._add_node())

    # -- recovery ---------------------------------------------------------------------------------

    def _live_actors(self) -> list:
        return list(named_workers(self.namespace).values())

    def workers_answer(self) -> bool:
        """Every worker of the deployment answers a ping (a restarted one has loaded its model)."""
        workers = named_workers(self.namespace)
        if len(workers) < len(self.spec.roles()):
            return False
        try:
            ray.get([w.ping.remote() for w in workers.values()], timeout=2)
            return True
        except Exception:  # one still restarting (or dead for good: the wait times out)
            return False

    def router_answers(self, index: int) -> bool:
        try:
            return httpx.get(self.urls[index] + "/health", timeout=2).json().get("status") == "ok"
        except (httpx.HTTPError, ValueError):
            return False

    def wait_router(self, index: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.router_answers(index):
            if self.routers[index].poll() is not None:
                raise RuntimeError(f"pdserve router on {self.urls[index]} exited with {self.routers[index].returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pdserve router on {self.urls[index]} not healthy within {timeout:.0f} s")
            time.sleep(0.2)

    def recovered(self) -> bool:
        return self.workers_answer() and all(self.router_answers(i) for i in range(len(self.urls)))

    # -- what is left -----------------------------------------------------------------------------

    def kv_blocks_in_use(self) -> int:
        stats = ray.get([w.stats.remote("chaos") for w in self._live_actors()], timeout=60)
        return sum(s.num_kv_blocks - s.num_free_kv_blocks for s in stats)

    def object_store_bytes(self) -> int:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        reply = get_memory_info_reply(get_state_from_address(self.cluster.address))
        return int(reply.store_stats.object_store_bytes_used)

    def shutdown(self) -> None:
        for router in self.routers:
            if router is not None and router.poll() is None:
                os.killpg(router.pid, signal.SIGTERM)
        for router in self.routers:
            if router is not None:
                try:
                    router.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(router.pid, signal.SIGKILL)
                    router.wait()
        try:
            stop_workers(self._live_actors())
        finally:
            ray.shutdown()
            self.cluster.shutdown()
