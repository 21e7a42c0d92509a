"""Running a request's choices: each choice is one request to the orchestrator; n > 1 runs them
concurrently and interleaves their updates. Also where the request-level metrics are recorded."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from router.choice import ChoiceState, ChoiceUpdate
from router.errors import APIError
from services.metrics import METRICS
from services.protocol import TokenDelta

if TYPE_CHECKING:
    from router.completions import Prepared


async def run_choices(state, prep: Prepared) -> AsyncIterator[tuple[ChoiceState, ChoiceUpdate]]:
    """Run every choice concurrently; yield each update as it comes. Closing this iterator
    cancels every choice, which aborts their requests on the workers."""
    start = time.perf_counter()
    choices = []
    for p, prompt in enumerate(prep.prompts):
        for j in range(prep.n):
            # With n > 1 and a seed, choice j uses seed + j: different choices, each reproducible.
            seed = None if prep.params.seed is None else (prep.params.seed + j) % 2**63
            choices.append(ChoiceState(p * prep.n + j, state.tokenizer, replace(prep.params, seed=seed), prompt))

    if len(choices) == 1:  # the common case needs no tasks: one hop less per token
        items = _single(state, prep, choices[0], start)
    else:
        items = _interleaved(state, prep, choices, start)
    try:
        async with contextlib.aclosing(items):
            async for item in _within(items, state.request_timeout):
                yield item
    finally:
        METRICS.e2e_request_latency.observe(time.perf_counter() - start)
        for c in choices:
            METRICS.prompt_tokens.inc(len(c.prompt_token_ids))
            METRICS.generation_tokens.inc(len(c.token_ids))
            if c.finish_reason is not None:
                METRICS.request_success.labels(c.finish_reason).inc()


def refuse_past_deadline(state, prep: Prepared) -> None:
    """Honest, fast refusal: with a request deadline, a request that the prefill queue would not
    reach before it passes is answered 503 + Retry-After now, not 504 after the wait. Only where
    every prompt of it would go to the prefill pool and the router has measured the pool (see
    `Orchestrator.first_token_estimate`); the shortest of their waits is a lower bound of its own."""
    if state.request_timeout is None:
        return
    waits = [state.orchestrator.first_token_estimate(prompt) for prompt in prep.prompts]
    wait = None if None in waits else min(waits)
    if wait is not None and wait > state.request_timeout:
        METRICS.requests_refused.labels(reason="deadline").inc()
        raise APIError(503, f"the prefill queue would reach this prompt in about {wait:.1f} s, past the server's "
                            f"deadline of {state.request_timeout:g} s", retry_after=math.ceil(wait - state.request_timeout))


async def _within(items: AsyncIterator, timeout: float | None) -> AsyncIterator:
    """`items`, ended by a 504 once `timeout` seconds have passed (None: no deadline). The deadline
    interrupts only the wait for the next item: cancelling that wait unwinds `items`, which aborts
    the request on the workers."""
    if timeout is None:
        async for item in items:
            yield item
        return
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                item = await anext(items)
        except StopAsyncIteration:
            return
        except TimeoutError:
            METRICS.request_timeouts.inc()
            raise APIError(504, f"the request ran past the server's deadline of {timeout:g} s") from None
        yield item


async def _single(state, prep: Prepared, choice: ChoiceState, start: float
                  ) -> AsyncIterator[tuple[ChoiceState, ChoiceUpdate]]:
    async with contextlib.aclosing(_updates(state, prep, choice, start)) as updates:
        async for update in updates:
            yield choice, update


async def _updates(state, prep: Prepared, choice: ChoiceState, start: float) -> AsyncIterator[ChoiceUpdate]:
    """One choice's updates; closing this iterator aborts its request on the workers."""
    last = None
    deltas = state.orchestrator.generate(f"{prep.request_id}-{choice.index}", choice.prompt_token_ids, choice.params)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            now = time.perf_counter()
            if last is None:
                METRICS.time_to_first_token.observe(now - start)
            else:
                for _ in delta.token_ids:
                    METRICS.inter_token_latency.observe((now - last) / len(delta.token_ids))
            last = now
            if prep.prompt_only:  # max_tokens 0: the token the workers had to sample is no part of the answer
                delta = TokenDelta([], None if delta.logprobs is None else [], delta.finish_reason and "length",
                                   delta.num_cached_tokens, prompt_logprobs=delta.prompt_logprobs)
            yield choice.update(delta)
            if choice.finish_reason is not None:
                return  # a stop string ended it early: closing the deltas aborts it on the worker


async def _interleaved(state, prep: Prepared, choices: list[ChoiceState], start: float
                       ) -> AsyncIterator[tuple[ChoiceState, ChoiceUpdate]]:
    """Every choice's updates as they come, each choice in its own task."""
    queue: asyncio.Queue = asyncio.Queue()

    async def one(choice: ChoiceState) -> None:
        try:
            async with contextlib.aclosing(_updates(state, prep, choice, start)) as updates:
                async for update in updates:
                    await queue.put((choice, update))
        except Exception as error:
            await queue.put((choice, error))
        finally:
            await queue.put((choice, None))

    tasks = [asyncio.create_task(one(c)) for c in choices]
    remaining = len(tasks)
    try:
        while remaining:
            choice, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
