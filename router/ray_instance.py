"""The Ray instance `pdserve serve` runs in: one of its own on this machine, or a cluster it joins,
with Ray's token authentication (RAY_AUTH_MODE=token) checked before joining."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from router.launcher import ClusterSpec

AUTH_MODES = ("disabled", "token")
TOKEN_SOURCES = "RAY_AUTH_TOKEN, or a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token"


def init_local_ray(spec: ClusterSpec, num_cpus: int | None = None) -> None:
    """A one-machine Ray instance of its own that advertises both roles; the dashboard stays off.

    `address="local"`, not Ray's default None: that joins the cluster named in RAY_ADDRESS or the
    one the last `ray start` on this host recorded (/tmp/ray/ray_current_cluster), whoever started
    it, and then refuses num_cpus. "local" always starts a new instance (on free ports). Ray turns
    token authentication on for a new local instance unless RAY_AUTH_MODE=disabled (its token in
    ~/.ray/auth_token, made on first use), so every process of it needs the token."""
    check_auth_environment()
    num_workers = len(spec.roles())
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), namespace=spec.namespace,
             include_dashboard=False, resources={spec.prefill_resource: num_workers, spec.decode_resource: num_workers},
             logging_level=logging.WARNING)


def connect_ray(spec: ClusterSpec, address: str | None) -> bool:
    """Start a Ray instance of its own (`address` None) or join a cluster (`auto`: RAY_ADDRESS, else
    the last `ray start` on this host; or HOST:PORT). Returns whether the instance is local."""
    if address is None:
        init_local_ray(spec)
        return True
    join_cluster(address, spec.namespace)
    return False


def join_cluster(address: str, namespace: str) -> None:
    """`ray.init` to a running cluster (`pdserve serve --address`, `router`, `scale`). A cluster
    started with RAY_AUTH_MODE=token refuses a process without its token: the error says which of
    the two is missing instead of Ray's retries and traceback."""
    mode = check_auth_environment()
    try:
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)
    except Exception as error:  # Ray wraps the refusal in ConnectionError / RuntimeError
        if not _refused_for_auth(error):
            raise
        if mode == "token":
            raise RuntimeError(f"the Ray cluster at {address} refused this process's token ({TOKEN_SOURCES}): "
                               f"it is not the cluster's token") from None
        raise RuntimeError(f"the Ray cluster at {address} requires token authentication: set RAY_AUTH_MODE=token "
                           f"and the cluster's token in {TOKEN_SOURCES} (on Kubernetes: the Secret named in "
                           f"the RayCluster's authOptions)") from None


def check_auth_environment() -> str:
    """The authentication mode this process will use ("disabled" or "token"), after checking that
    RAY_AUTH_MODE is one Ray knows and that token mode has a token to send. Ray itself aborts the
    process on an unreadable RAY_AUTH_TOKEN_PATH, so that is refused here, by name."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode not in AUTH_MODES:
        raise ValueError(f"RAY_AUTH_MODE must be one of {', '.join(AUTH_MODES)}, got {mode!r}")
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path and not os.environ.get("RAY_AUTH_TOKEN"):
        try:
            readable = bool(Path(path).read_text().strip())
        except OSError as error:
            raise ValueError(f"RAY_AUTH_TOKEN_PATH={path!r} cannot be read: {error.strerror}") from None
        if not readable:
            raise ValueError(f"RAY_AUTH_TOKEN_PATH={path!r} is empty; it must hold the cluster's token")
    if mode in (None, "disabled"):
        return "disabled"
    if not (os.environ.get("RAY_AUTH_TOKEN") or path or (Path.home() / ".ray" / "auth_token").is_file()):
        raise ValueError(f"RAY_AUTH_MODE=token but this process has no token: set {TOKEN_SOURCES}")
    return "token"


def _refused_for_auth(error: BaseException | None) -> bool:
    """Whether Ray's connection error (or one it was raised from) is an authentication refusal."""
    while error is not None:
        if isinstance(error, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False
