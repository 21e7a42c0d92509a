"""Test harness: the local cluster helpers, which live in the installed `benchmarks.local_cluster` (the
benchmarks use them too); re-exported here under the names the tests import."""

from benchmarks.local_cluster import (  # noqa: F401
    crash_and_restart,
    free_port,
    process_id,
    router_server,
    serve_router,
    served_app,
    set_step_delay,
    step_delay,
    two_node_cluster,
    wait_for,
    wait_healthy,
    wait_restarted,
)
