"""A free loopback port for a router that a local cluster (a test, a benchmark, `pdserve chaos`) starts."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free loopback port between Ray's worker ports (10002-19999) and the OS's ephemeral range
    (32768 and up here). A port the OS hands out for port 0 is in the ephemeral range, where Ray's
    own processes also take theirs: seen, `pdserve serve` lost its router port to the Ray instance it
    had just started."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port in 20000-32000")
