"""One choice of a response: incremental text with stop strings applied, logprobs, and counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.protocol import TokenDelta
from services.sampling_params import SamplingParams
from services.text_stream import TextStream
from services.tokenizer import Tokenizer


@dataclass(slots=True)
class ChoiceUpdate:
    """What a choice adds from one delta: new text, its tokens' logprobs, and maybe its end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass(slots=True)
class ChoiceState:
    index: int
    tokenizer: Tokenizer
    params: SamplingParams
    prompt_token_ids: list[int]
    stream: TextStream = field(init=False)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float]] | None = None  # entry i: prompt token i + 1 (echo + logprobs)

    def __post_init__(self) -> None:
        self.stream = TextStream(self.tokenizer, self.prompt_token_ids, self.params)

    @property
    def text(self) -> str:
        return self.stream.text

    def update(self, delta: TokenDelta) -> ChoiceUpdate:
        """Consume one delta. A completed stop string sets `finish_reason` to "stop" before the
        workers know: the caller then closes the stream, which aborts the request."""
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        emitted = self.stream.feed(delta.token_ids, delta.finish_reason is not None)
        used = self.stream.consumed  # tokens after a stop string's end do not count
        token_ids = delta.token_ids[:used]
        logprobs = None if delta.logprobs is None else delta.logprobs[:used]
        self.token_ids += token_ids
        self.finish_reason = "stop" if self.stream.stopped else delta.finish_reason
        return ChoiceUpdate(self.index, emitted, token_ids, logprobs, self.finish_reason)


def token_id_name(token_id: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` names it (two tokens never share a name)."""
    return f"token_id:{token_id}"


def completion_logprobs(name: Callable[[int], str], token_ids: list[int], logprobs: list[dict[int, float]],
                        text_offsets: list[int]) -> dict:
    """The legacy completions `logprobs` object for these tokens; `name` gives a token's text, and
    `text_offsets` where each token's text begins in the returned text (`router/text_offsets.py`)."""
    return {
        "tokens": [name(t) for t in token_ids],
        "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs)],
        "top_logprobs": [{name(k): v for k, v in lp.items()} for lp in logprobs],
        "text_offset": list(text_offsets),
    }


def prompt_completion_logprobs(name: Callable[[int], str], prompt_ids: list[int],
                               prompt_logprobs: list[dict[int, float]], text_offsets: list[int]) -> dict:
    """The legacy `logprobs` object for an echoed prompt: its first token has none (nothing precedes it)."""
    rest = completion_logprobs(name, prompt_ids[1:], prompt_logprobs, text_offsets[1:])
    return {"tokens": [name(prompt_ids[0])] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": text_offsets[:1] + rest["text_offset"]}


def chat_logprobs(name: Callable[[int], str], token_ids: list[int], logprobs: list[dict[int, float]],
                  num_top: int) -> dict:
    """The chat `logprobs` object: one entry per token with its top alternatives."""
    def entry(token_id: int, value: float) -> dict:
        text = name(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for t, lp in zip(token_ids, logprobs):
        alternatives = sorted(lp.items(), key=lambda kv: -kv[1])[:num_top]
        content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in alternatives]})
    return {"content": content}
