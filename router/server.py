"""The router's HTTP server: the app on uvicorn until Ctrl-C / SIGTERM.

`pdserve serve` runs it beside the workers it started. `pdserve router` runs one more router for
workers that already run: routers find the workers by name and share them, so several routers behind
one load balancer scale the HTTP side (one router carries ~5,000-9,000 streamed tokens/s, see the
docs/benchmarks.md) and one can restart without stopping the workers.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import ray

log = logging.getLogger("pdserve.launcher")


def run_router(spec, model_name: str, host: str, port: int, **router_options) -> None:
    """Serve the router for the workers of `spec` until a signal."""
    import uvicorn

    from router.app import create_app
    from router.launcher import build_router_state

    app = create_app(build_router_state(spec, model_name, **router_options))
    log.warning("pdserve: %s mode, serving %s on http://%s:%d", spec.mode, model_name, host, port)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal under the
    # handlers it found: make SIGTERM, like SIGINT, unwind into the caller's cleanup.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        uvicorn.Server(config).run()  # on uvloop and httptools (dependencies), as uvicorn[standard]
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the signal
        log.warning("pdserve: shutting down")


def attach(address: str, namespace: str, host: str, port: int, model: str | None, model_name: str | None,
           wait: float, **router_options) -> None:
    """A router for the workers already running in `namespace` (it stops none of them on exit).
    Its mode, model folder and engine limits are the workers' own (`model` overrides the folder
    where this host mounts it elsewhere); it waits up to `wait` seconds for a decode worker."""
    from router.launcher import ClusterSpec
    from router.ray_instance import join_cluster
    from router.worker_pool import named_workers

    join_cluster(address, namespace)
    try:
        deadline = time.monotonic() + wait
        workers = named_workers(namespace)
        while not any(name.startswith("decode-") for name in workers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no decode worker in namespace {namespace!r} after {wait:g} s; "
                                   f"start the workers with pdserve serve")
            time.sleep(1.0)
            workers = named_workers(namespace)
        name, worker = next(iter(workers.items()))
        try:
            template = ray.get(worker.worker_spec.remote(), timeout=wait or None)
        except Exception as error:  # still starting past the wait, or gone
            raise RuntimeError(f"worker {name} did not describe itself: {type(error).__name__}: {error}") from None
        mode = "disaggregated" if any(name.startswith("prefill-") for name in workers) else "colocated"
        spec = ClusterSpec(model=model or template.model, mode=mode, namespace=namespace,
                           engine_options=dict(template.engine_options))
        run_router(spec, model_name or Path(spec.model).name, host, port, **router_options)
    finally:
        ray.shutdown()
