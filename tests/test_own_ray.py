"""`pdserve serve` starts a Ray instance of its own beside someone else's `ray start --head` on the
same host (Ray's default address discovery would join that one), and `--address auto` joins it.

The foreign head is a real `ray start` whose temporary folder (RAY_TMPDIR) is private to this module,
so only processes given that folder can discover it; it is stopped by its process group, never by
`ray stop`, which would stop every Ray instance on the host."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from cluster_harness import free_port, wait_healthy

CONNECT = """
import sys, ray
from router.launcher import ClusterSpec
from router.ray_instance import connect_ray
local = connect_ray(ClusterSpec(model="x", namespace="own-ray"), None if sys.argv[1] == "-" else sys.argv[1])
print("joined", local, ray.get_runtime_context().gcs_address, ray.cluster_resources().get("pd_prefill", 0))
ray.shutdown()
"""


@pytest.fixture(scope="module")
def foreign_head():
    """(address, env): a head started with `ray start` as another user would, and the environment in
    which it is this host's latest cluster (as /tmp/ray/ray_current_cluster makes it for everyone)."""
    folder = tempfile.mkdtemp(prefix="pdr", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": folder}
    port = free_port()
    ray_cli = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray_cli, "start", "--head", "--num-cpus", "1", "--port", str(port), "--block",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    recorded = Path(folder, "ray", "ray_current_cluster")
    try:
        deadline = time.monotonic() + 60
        while not recorded.exists() or not recorded.read_text().strip():
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.2)
        yield recorded.read_text().strip(), env
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # disposable; `ray start --block` takes ~20 s over a SIGTERM
        head.wait()
        _kill_leftovers(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group it leads (Ray's processes stay in it), SIGKILL after 20 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _kill_leftovers(folder: str) -> None:
    """Any process whose command line names this module's private folder (nobody else's)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if folder.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _connect(address: str | None, env: dict[str, str]) -> tuple[bool, str, float]:
    """What `connect_ray` does in a fresh process: (local?, the GCS address, pd_prefill slots)."""
    done = subprocess.run([sys.executable, "-c", CONNECT, address or "-"], env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("joined ")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    _, local, gcs, slots = lines[-1].split()
    return local == "True", gcs, float(slots)


def test_without_an_address_it_starts_its_own_ray_even_where_ray_address_names_one(foreign_head):
    """RAY_ADDRESS, like the host's latest cluster, names the cluster to join with `--address auto` only."""
    address, env = foreign_head
    local, gcs, slots = _connect(None, env | {"RAY_ADDRESS": address})
    assert local and gcs != address and slots == 2  # its own, advertising the roles


def test_address_auto_joins_the_cluster_on_the_host(foreign_head):
    address, env = foreign_head
    assert _connect("auto", env) == (False, address, 0)


def test_serve_beside_a_foreign_ray_serves_from_its_own(foreign_head, tiny_path):
    """The whole command, where Ray's default discovery finds the foreign head (the issue's case)."""
    address, env = foreign_head
    port = free_port()
    command = [sys.executable, "-m", "router.cli", "serve", "--model", str(tiny_path), "--port", str(port),
               "--max-num-seqs", "4", "--kv-cache-memory-gb", "0.1", "--peak-tflops", "1", "--peak-gbps", "10"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, 180, "pdserve serve beside a foreign Ray")
        body = {"prompt": [1, 5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 3
        assert _connect("auto", env) == (False, address, 0)  # nothing of pdserve's went to the foreign head
    finally:
        _stop_group(server)
