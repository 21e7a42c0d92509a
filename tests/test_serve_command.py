"""`pdserve serve` as a user runs it (what `make serve` runs): a real process that starts its own
Ray, serves, answers, and on SIGTERM stops everything it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from cluster_harness import free_port, wait_healthy


def _descendants(pid: int) -> dict[int, str]:
    """{pid: name} of every process below `pid`, from /proc."""
    parents: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            head, rest = open(f"/proc/{entry}/stat").read().rsplit(")", 1)
        except OSError:
            continue
        names[int(entry)] = head.split("(", 1)[1]
        parents.setdefault(int(rest.split()[1]), []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found[child] = names[child]
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("stop", ["process", "group", "interrupt"])
def test_serve_answers_then_a_signal_stops_everything_it_started(tiny_path, stop):
    """SIGTERM to pdserve alone, or to its whole process group (as a service manager or a container
    runtime stops it): then Ray's raylet dies with it, and pdserve must clean up after a raylet
    already gone (it used to hang asking the dead raylet for the workers' names). Or SIGINT to the
    group, as Ctrl-C in a terminal sends it; that run also has `--api-key`: requests without the key,
    or with another, are refused 401."""
    port = free_port()
    command = [sys.executable, "-m", "router.cli", "serve", "--model", str(tiny_path), "--port", str(port),
               "--max-num-seqs", "8", "--kv-cache-memory-gb", "0.1"]
    key = "sekret-key" if stop == "interrupt" else None
    if key:
        command += ["--api-key", key]
    env = {**os.environ, "RAY_ADDRESS": ""}  # its own Ray, whatever the caller's environment says
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)  # its own process group, as a terminal gives it
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, 120, "pdserve serve")
        body = {"prompt": [1, 5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        if key:
            for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": key}):
                refused = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
                assert (refused.status_code, refused.json()["error"]["code"]) == (401, 401), headers
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        answer = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["finish_reason"] == "length"
        started = _descendants(server.pid)  # Ray's processes and the workers
        assert "raylet" in started.values() and "gcs_server" in started.values()
        if stop == "process":
            server.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.pid, signal.SIGINT if stop == "interrupt" else signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        output = server.stdout.read()
        device = "cuda:0" if torch.cuda.is_available() else "cpu"  # a local GPU is shared by the two workers
        for name in ("prefill-0", "decode-0"):
            assert f"pdserve: {name} runs on {device} (node " in output, output
        deadline = time.monotonic() + 30
        while alive := {pid: name for pid, name in started.items() if _running(pid)}:
            assert time.monotonic() < deadline, f"left running: {alive}"
            time.sleep(0.2)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)  # its whole group: Ray's processes too
            server.wait()
