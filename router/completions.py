"""/v1/completions and /v1/chat/completions: prepare the request, run its choices, shape the reply."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router.choice import (
    ChoiceState,
    chat_logprobs,
    completion_logprobs,
    prompt_completion_logprobs,
    token_id_name,
)
from router.choice_runner import run_choices
from router.errors import APIError
from router.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from router.text_offsets import TextOffsets
from services.sampling_params import SamplingParams


@dataclass
class Prepared:
    """A validated request, ready to run: one prompt per choice group, n choices each."""

    request_id: str
    chat: bool
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo_texts: list[str] | None  # completions `echo`: the prompt text to put before each choice
    num_top_logprobs: int  # chat: top_logprobs
    tokens_as_ids: bool = False  # logprob tokens as "token_id:<id>" (return_tokens_as_token_ids)
    continuous_usage: bool = False  # usage so far in every chunk (stream_options.continuous_usage_stats)
    # max_tokens 0 with echo: the prompt is scored and nothing generated. The workers still run with
    # max_tokens 1 (an engine request samples a token; so does vLLM's here): that token is dropped
    # as it arrives (choice_runner), and a prefill worker exports no KV for a 1-token request.
    prompt_only: bool = False


def _check_model(state, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


def _check_length(state, prompt: list[int], max_tokens: int) -> None:
    limit = state.max_model_len
    if len(prompt) >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                            f"{len(prompt)} input tokens. Please reduce the length of the input.", "input_tokens")
    if len(prompt) + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{max_tokens} output tokens and your prompt contains {len(prompt)} input tokens, "
                            f"for a total of {len(prompt) + max_tokens} tokens.", "max_tokens")
    _check_token_ids(state, prompt, "prompt")


def _check_token_ids(state, token_ids, param: str) -> None:
    vocab = state.vocab_size
    if any(not 0 <= t < vocab for t in token_ids):
        raise APIError(400, f"{param} token ids must be in [0, {vocab})", param)


def _params(state, body, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
            ) -> SamplingParams:
    if body.n > state.max_n:
        raise APIError(400, f"n must be at most {state.max_n}", "n")
    # The engine skips ids outside its vocabulary here; a client that sent one made a mistake to hear about.
    _check_token_ids(state, body.stop_token_ids or (), "stop_token_ids")
    _check_token_ids(state, [int(k) for k in body.logit_bias or {}], "logit_bias")
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as error:
        raise APIError(400, str(error), str(error).split(" ", 1)[0]) from None


def prepare_completion(state, body: CompletionRequest, request_id: str) -> Prepared:
    _check_model(state, body.model)
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    prompts = [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in raw]
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    for p in prompts:
        _check_length(state, p, max_tokens)
    if max_tokens == 0 and body.min_tokens:
        raise APIError(400, f"min_tokens must be between 0 and max_tokens (0), got {body.min_tokens}", "min_tokens")
    echo = [state.tokenizer.decode(p, skip_special_tokens=True) for p in prompts] if body.echo else None
    # echo + logprobs scores the prompt too (what evaluation harnesses ask for): prompt logprobs.
    params = _params(state, body, max(1, max_tokens), body.logprobs, body.logprobs if body.echo else None)
    return Prepared(request_id, False, state.model_name, prompts, params,
                    body.n, body.stream, body.stream_flags.include_usage, echo, 0,
                    body.return_tokens_as_token_ids,
                    body.stream_flags.continuous_usage_stats, prompt_only=max_tokens == 0)


def prepare_chat(state, body: ChatCompletionRequest, request_id: str) -> Prepared:
    _check_model(state, body.model)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        prompt = state.tokenizer.encode_chat(messages)
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = requested if requested is not None else max(1, state.max_model_len - len(prompt))
    _check_length(state, prompt, max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return Prepared(request_id, True, state.model_name, [prompt], _params(state, body, max_tokens, logprobs),
                    body.n, body.stream, body.stream_flags.include_usage, None,
                    body.top_logprobs or 0, body.return_tokens_as_token_ids,
                    body.stream_flags.continuous_usage_stats)


def usage(prep: Prepared, choices: list[ChoiceState]) -> dict:
    prompt_tokens = sum(len(p) for p in prep.prompts)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.num_cached_tokens for c in choices if c.index % prep.n == 0)  # once per prompt
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _choice_body(state, prep: Prepared, choice: ChoiceState, text: str, token_ids: list[int],
                 logprobs: list | None, finish_reason: str | None, stream: bool, first: bool,
                 offsets: TextOffsets | None = None) -> dict:
    """One choice's part of a response (all of it) or of a chunk (`text` and the tokens since the
    last one). A completion's `echo` goes before the first: its text, and with logprobs the prompt's.
    `offsets`: the choice's output `text_offset`s so far (completions with logprobs)."""
    echo = prep.echo_texts[choice.index // prep.n] if prep.echo_texts else ""
    name = token_id_name if prep.tokens_as_ids else state.tokenizer.token_text
    lp = None
    if logprobs is not None:
        # Known only at the end: text still held back mid-stream (a partial character) has tokens after it.
        end = None if finish_reason is None else len(echo) + len(choice.text)
        lp = (chat_logprobs(name, token_ids, logprobs, prep.num_top_logprobs) if prep.chat else
              completion_logprobs(name, token_ids, logprobs, offsets.push(token_ids, end)))
    if not prep.chat:
        if first and echo:
            text = echo + text
            if lp is not None and choice.prompt_logprobs is not None:
                # The echo is the prompt decoded without its special tokens (prepare_completion).
                at = TextOffsets(state.tokenizer, True).push(choice.prompt_token_ids, len(echo))
                prompt = prompt_completion_logprobs(name, choice.prompt_token_ids, choice.prompt_logprobs, at)
                lp = {key: prompt[key] + lp[key] for key in lp}
        return {"index": choice.index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
    if stream:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
    return {"index": choice.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
            "finish_reason": finish_reason}


def _envelope(prep: Prepared, created: int, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if prep.chat else "text_completion"
    prefix = "chatcmpl-" if prep.chat else "cmpl-"
    return {"id": prefix + prep.request_id, "object": kind, "created": created, "model": prep.model}


async def complete(state, prep: Prepared) -> dict:
    """The whole (non-streamed) response."""
    choices: dict[int, ChoiceState] = {}
    logprobs: dict[int, list] = {}
    async for choice, update in run_choices(state, prep):
        choices[choice.index] = choice
        if update.logprobs is not None:
            logprobs.setdefault(choice.index, []).extend(update.logprobs)
    ordered = [choices[i] for i in sorted(choices)]
    # A long echo's logprobs take a while to format: on the router's CPU threads, not its event loop.
    return await state.cpu.run(_response, state, prep, ordered, logprobs)


def _response(state, prep: Prepared, ordered: list[ChoiceState], logprobs: dict[int, list]) -> dict:
    bodies = []
    for c in ordered:
        bodies.append(_choice_body(state, prep, c, c.text, c.token_ids, logprobs.get(c.index) if c.params.logprobs
                                   is not None else None, c.finish_reason, False, True, _offsets(state, prep, c)))
    return {**_envelope(prep, int(time.time()), False), "choices": bodies, "usage": usage(prep, ordered)}


async def stream(state, prep: Prepared) -> AsyncIterator[str]:
    """SSE events: chunks, then (with include_usage) a usage chunk, then [DONE]. An error after the
    stream started is sent as an error event."""
    created = int(time.time())
    seen: dict[int, ChoiceState] = {}
    offsets: dict[int, TextOffsets] = {}
    try:
        async for choice, update in run_choices(state, prep):
            first = choice.index not in seen
            seen[choice.index] = choice
            if first:
                offsets[choice.index] = _offsets(state, prep, choice)
            text = update.text
            if not text and update.finish_reason is None and update.logprobs is None and not first:
                continue  # a held-back partial character or stop-string prefix: nothing to send yet
            body = _choice_body(state, prep, choice, text, update.token_ids, update.logprobs,
                                update.finish_reason, True, first, offsets[choice.index])
            chunk = {**_envelope(prep, created, True), "choices": [body]}
            if prep.continuous_usage:
                chunk["usage"] = usage(prep, list(seen.values()))
            yield _sse(chunk)
        if prep.include_usage:
            ordered = [seen[i] for i in sorted(seen)]
            yield _sse({**_envelope(prep, created, True), "choices": [], "usage": usage(prep, ordered)})
    except APIError as error:
        yield _sse(error.body())
    except Exception:
        yield _sse(APIError(500, "internal server error").body())
    yield "data: [DONE]\n\n"


def _offsets(state, prep: Prepared, choice: ChoiceState) -> TextOffsets:
    """Where the choice's output tokens begin in its text: after the echoed prompt, if any."""
    echo = prep.echo_texts[choice.index // prep.n] if prep.echo_texts else ""
    return TextOffsets(state.tokenizer, choice.params.skip_special_tokens, len(echo))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def new_request_id() -> str:
    return uuid.uuid4().hex


def tokenize(state, body: TokenizeRequest) -> dict:
    """vLLM's /tokenize answer: the ids a completion or chat request would feed the model."""
    _check_model(state, body.model)
    if body.prompt is not None:
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        try:
            ids = state.tokenizer.encode_chat([m.model_dump(exclude_none=True) for m in body.messages],
                                              add_generation_prompt=body.add_generation_prompt)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


def detokenize(state, body: DetokenizeRequest) -> dict:
    _check_model(state, body.model)
    _check_token_ids(state, body.tokens, "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

