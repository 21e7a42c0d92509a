"""A real two-node start, as a cluster operator does it: `ray start --head` advertising `pd_prefill`,
a second `ray start` advertising `pd_decode`, both with Ray token authentication on; then
`pdserve serve --address` against them, one streamed request end to end (the openai client), a
`pdserve scale`, and processes without the token (or with another) refused with a clear message.

Everything runs with a private RAY_TMPDIR and HOME, so nothing else on the host can discover this
cluster (nor this test another's), and the teardown stops exactly the processes it started: the
`ray start` process groups, then any process carrying this module's marker in its environment
(Ray's workers rename themselves, so their command lines do not say whose they are). Never
`ray stop`, which stops every Ray instance on the host."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from cluster_harness import free_port, wait_healthy

from services import Engine, SamplingParams
from services.cache_folder import cache_root

MARK = "PDSERVE_MULTINODE_TEST"
PROMPT = [1, 17, 99, 240, 35, 8]


def _marked(folder: str) -> list[int]:
    """Pids of live processes whose environment carries this module's marker for `folder`."""
    needle = f"{MARK}={folder}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


def _ray_start(env: dict, *args: str) -> subprocess.Popen:
    ray_cli = str(Path(sys.executable).with_name("ray"))
    return subprocess.Popen([ray_cli, "start", "--block", "--num-cpus", "1", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
                             "--dashboard-agent-listen-port", str(free_port()), *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(process: subprocess.Popen, sig: signal.Signals) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def cluster(tiny_path):
    """(address, env): two authenticated Ray nodes on loopback and the environment that holds the token."""
    folder = tempfile.mkdtemp(prefix="pdm", dir="/tmp")  # short: Ray's socket paths live under it
    Path(folder, "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env |= {"RAY_TMPDIR": folder, "HOME": f"{folder}/home", "PDSERVE_CACHE": str(cache_root()), MARK: folder,
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = [_ray_start(env, "--head", "--include-dashboard=false", "--port", str(port),
                        "--ray-client-server-port", str(free_port()),
                        "--dashboard-port", str(free_port()), "--resources", json.dumps({"pd_prefill": 1}))]
    try:
        recorded = Path(folder, "ray", "ray_current_cluster")
        deadline = time.monotonic() + 90
        while not recorded.exists() or not recorded.read_text().strip():
            assert nodes[0].poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.2)
        nodes.append(_ray_start(env, "--address", address, "--resources", json.dumps({"pd_decode": 2})))
        yield address, env
    finally:
        for node in reversed(nodes):
            _stop(node, signal.SIGKILL)  # disposable; `ray start --block` takes ~20 s over a SIGTERM
        for pid in _marked(folder):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (left := [p for p in _marked(folder) if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(folder, ignore_errors=True)
        assert not left, f"processes of this test still running: {left}"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pdserve(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "router.cli", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def test_serve_scale_and_refusals_on_an_authenticated_two_node_cluster(cluster, tiny_path):
    address, env = cluster
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--address", address, "--model",
                               str(tiny_path), "--port", str(port), "--max-num-seqs", "4", "--kv-cache-memory-gb",
                               "0.1", "--peak-tflops", "1", "--peak-gbps", "10", "--no-pin-cpus"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, 240, "pdserve serve --address on two nodes")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        want = Engine(model=str(tiny_path)).generate([PROMPT], SamplingParams(max_tokens=12, temperature=0,
                                                                             ignore_eos=True))[0].text
        stream = client.completions.create(model=tiny_path.name, prompt=PROMPT, max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [c.choices[0] for c in stream if c.choices]
        assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "length"

        scaled = _pdserve(env, "scale", "--address", address, "--decode", "2")
        assert scaled.returncode == 0, scaled.stderr[-2000:]
        assert scaled.stdout.strip().splitlines()[-1] == "added decode-1; removed none"

        # Ray retries a refused connection for 20 s by default; 2 tries are enough to be refused.
        quick = {"RAY_gcs_server_port_wait_time_s": "2"}
        no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")} | quick
        refused = _pdserve(no_token, "scale", "--address", address, "--decode", "1")
        assert refused.returncode == 2
        assert f"the Ray cluster at {address} requires token authentication" in refused.stderr, refused.stderr
        wrong = env | quick | {"RAY_AUTH_TOKEN": secrets.token_hex(32)}
        refused = _pdserve(wrong, "router", "--address", address, "--port", str(free_port()))
        assert refused.returncode == 2
        assert "refused this process's token" in refused.stderr, refused.stderr
        empty = env | {"RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": "/nonexistent/token"}
        refused = _pdserve(empty, "scale", "--address", address, "--decode", "1")
        assert refused.returncode == 2 and "RAY_AUTH_TOKEN_PATH='/nonexistent/token' cannot be read" in refused.stderr

        # The refused processes changed nothing: the two decode workers still answer.
        again = client.completions.create(model=tiny_path.name, prompt=PROMPT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert again.choices[0].text == want
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["status"] == "ok", health
    finally:
        _stop(server, signal.SIGTERM)


@pytest.mark.parametrize(("env", "message"), [
    ({"RAY_AUTH_MODE": "Token"}, "RAY_AUTH_MODE must be one of disabled, token, got 'Token'"),
    ({"RAY_AUTH_MODE": "token"}, "RAY_AUTH_MODE=token but this process has no token"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/nonexistent/t"}, "RAY_AUTH_TOKEN_PATH='/nonexistent/t' cannot"),
])
def test_the_auth_environment_is_refused_by_name_before_joining(monkeypatch, tmp_path, env, message):
    from router.ray_instance import check_auth_environment

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_auth_environment()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(empty))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(ValueError, match="is empty"):
        check_auth_environment()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)  # the variable wins over the file, as in Ray
    assert check_auth_environment() == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert check_auth_environment() == "disabled"
