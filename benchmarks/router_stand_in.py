"""The real router app (routes, boundary, errors, OpenAPI document) in front of stand-in workers: a
pool that always has both roles and an orchestrator that answers at once with made-up tokens. For
tests and benchmarks of the HTTP boundary that need no Ray and no model; `served` runs it on a real
uvicorn. `tests/router_stand_in.py` re-exports it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace

from benchmarks.local_cluster import served_app
from router.app import RouterState, create_app
from services.preset_tokenizer import CHAT_TEMPLATE, build_tokenizer
from services.protocol import TokenDelta
from services.sampling_params import SamplingParams
from services.tokenizer import Tokenizer


def tokenizer() -> Tokenizer:
    """The `tiny` preset's tokenizer and chat template, built in memory (no model folder)."""
    return Tokenizer(build_tokenizer(500), bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                     chat_template=CHAT_TEMPLATE)


class StandInPool:
    """Both roles always alive; no stats to report."""

    kv_bytes_per_second = None

    async def poll(self, timeout: float = 2.0) -> list:
        return []

    def role(self, role: str) -> list:
        return [role]

    def best(self, role: str, cached: dict | None = None):
        return None

    def discover(self) -> list[str]:
        return []


class StandInOrchestrator:
    """Colocated; each request gets `max_tokens` tokens in one delta (logprobs and prompt logprobs
    when asked), each token the one after the previous, from the prompt's last."""

    mode = "colocated"
    placement = SimpleNamespace(first_token_seconds=lambda tokens, worker: None)

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenDelta]:
        token_ids = [(prompt_token_ids[-1] + 1 + i) % self.vocab_size for i in range(params.max_tokens)]
        logprobs = None if params.logprobs is None else [{t: -1.0, (t + 1) % self.vocab_size: -2.0} for t in token_ids]
        prompt_logprobs = (None if params.prompt_logprobs is None else
                           [{t: -0.5} for t in prompt_token_ids[1:]])
        yield TokenDelta(token_ids, logprobs, "length", prompt_logprobs=prompt_logprobs)

    def first_token_estimate(self, prompt_token_ids: list[int]) -> float | None:
        return None

    async def renew_channels(self, timeout: float = 2.0) -> None:
        pass

    def forget(self, worker_name: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


def state(tok: Tokenizer | None = None, orchestrator: StandInOrchestrator | None = None, max_model_len: int = 256,
          **options) -> RouterState:
    """A RouterState over the stand-ins; `options` are RouterState fields."""
    tok = tok or tokenizer()
    return RouterState(model_name="stand-in", tokenizer=tok, max_model_len=max_model_len, vocab_size=tok.vocab_size,
                       pool=StandInPool(), orchestrator=orchestrator or StandInOrchestrator(tok.vocab_size),
                       **options)


@contextlib.contextmanager
def served(router_state: RouterState):
    """The router app for `router_state` on a real uvicorn over loopback (in a thread); yields its URL."""
    with served_app(create_app(router_state)) as url:
        yield url
