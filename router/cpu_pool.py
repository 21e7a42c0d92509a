"""The router's threads for CPU-heavy request work: parsing large bodies, tokenizing, rendering chat
templates, detokenizing echoed prompts, formatting long logprob lists and the JSON answer.

On the event loop, one 4 MB prompt stalled `/health` and every stream of the router for a second or
more. In these threads the loop keeps running: tokenizers and detokenizers release the GIL, and the
rest is Python code, which yields the GIL every few milliseconds. At most `max_threads` requests do
such work at once; the others wait their turn in arrival order, so a burst of large requests cannot
take every core from the loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class CPUPool:
    def __init__(self, max_threads: int = 2) -> None:
        self.max_threads = max_threads
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="pdserve-cpu")

    async def run(self, func: Callable[..., T], *args, **kwargs) -> T:
        """`func(*args, **kwargs)` on one of the threads. Cancelling the await does not stop a call
        already running (a thread cannot be interrupted); its result is dropped."""
        call = functools.partial(func, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
