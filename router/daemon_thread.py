"""Blocking calls to Ray's control store, each on a daemon thread of its own.

Such a call can block forever once the control store is gone (its raylet killed with the router's process
group): made on the event loop it froze every request and uvicorn's shutdown; on an executor's thread it would
hold the process's exit. A daemon thread holds neither; the caller waits on the returned future with a timeout
(`.result(timeout)`, or `asyncio.wrap_future` under `asyncio.wait_for`) and gives up on a stuck call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def on_daemon_thread(fn: Callable[[], T], name: str = "pdserve-lookup") -> Future[T]:
    """fn() started on a new daemon thread; its result or exception in the future."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():  # cancelled before it started
            return
        try:
            future.set_result(fn())
        except BaseException as error:  # handed to whoever waits
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
