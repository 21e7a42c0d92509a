"""Over-HTTP checks of the sampling options: each request, streamed and not, answers as the single
engine does with the same SamplingParams, and the option changes that answer (so a router or worker
that dropped it on the way would fail the check)."""

from __future__ import annotations

import json

import httpx

from services import Engine, SamplingParams
from services.tokenizer import Tokenizer

PROMPT = [1] + [40 + (7 * i) % 300 for i in range(11)]


def cases(tokenizer: Tokenizer, greedy: list[int]) -> list[tuple[str, dict, dict]]:
    """(name, request fields, SamplingParams fields): each against the same request without them.
    `greedy` is the engine's greedy output for PROMPT (used to pick stop tokens that do occur)."""
    sampled = {"temperature": 1.0, "seed": 3}
    stop_id = greedy[4]  # the 5th greedy token; the first time it occurs is where a stop ends the request
    stop_at = greedy.index(stop_id)
    special = next(i for i in tokenizer.all_special_ids if i not in (tokenizer.bos_token_id, tokenizer.eos_token_id))
    text = tokenizer.decode(greedy)
    start = next(i for i in range(8, len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    stop_text = text[start:start + 3]
    return [
        ("top_k", {**sampled, "top_k": 2}, {**sampled, "top_k": 2}),
        ("min_p", {**sampled, "min_p": 0.5}, {**sampled, "min_p": 0.5}),
        ("presence_penalty", {"temperature": 0, "presence_penalty": 2.0}, {"temperature": 0, "presence_penalty": 2.0}),
        ("frequency_penalty", {"temperature": 0, "frequency_penalty": 2.0},
         {"temperature": 0, "frequency_penalty": 2.0}),
        ("repetition_penalty", {"temperature": 0, "repetition_penalty": 2.0},
         {"temperature": 0, "repetition_penalty": 2.0}),
        ("logit_bias", {"temperature": 0, "logit_bias": {str(greedy[0] + 1): 100}},
         {"temperature": 0, "logit_bias": {greedy[0] + 1: 100}}),
        ("stop_token_ids", {"temperature": 0, "stop_token_ids": [stop_id]},
         {"temperature": 0, "stop_token_ids": (stop_id,)}),
        # The same stop token, held off until min_tokens tokens are out.
        ("min_tokens", {"temperature": 0, "stop_token_ids": [stop_id], "min_tokens": stop_at + 2},
         {"temperature": 0, "stop_token_ids": (stop_id,), "min_tokens": stop_at + 2}),
        ("include_stop_str_in_output", {"temperature": 0, "stop": [stop_text], "include_stop_str_in_output": True},
         {"temperature": 0, "stop": (stop_text,), "include_stop_str_in_output": True}),
        # A special token forced by logit_bias: kept in the text only when asked.
        ("skip_special_tokens", {"temperature": 0, "logit_bias": {str(special): 100}, "skip_special_tokens": False},
         {"temperature": 0, "logit_bias": {special: 100}, "skip_special_tokens": False}),
    ]


def _baseline(fields: dict) -> dict:
    """The request without the option under test: only temperature and seed kept."""
    return {k: v for k, v in fields.items() if k in ("temperature", "seed")}


def check_sampling_options_match_engine(url: str, model: str) -> None:
    engine = Engine(model=model)
    tokenizer = Tokenizer.from_folder(model)
    max_tokens = 24
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    for name, body_fields, param_fields in cases(tokenizer, greedy.token_ids):
        want = engine.generate([PROMPT], SamplingParams(max_tokens=max_tokens, ignore_eos=True, **param_fields))[0]
        without = engine.generate([PROMPT], SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                           **_baseline(param_fields)))[0]
        assert (want.text, want.token_ids) != (without.text, without.token_ids), f"{name} changes nothing here"
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, **body_fields}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, (name, response.text)
        answer = response.json()
        choice = answer["choices"][0]
        got = (choice["text"], choice["finish_reason"], answer["usage"]["completion_tokens"])
        assert got == (want.text, want.finish_reason, len(want.token_ids)), name
        assert _streamed(url, body) == (want.text, want.finish_reason), name


def check_chat_max_completion_tokens(url: str, model: str) -> None:
    """Chat's `max_completion_tokens` (OpenAI's name for max_tokens) bounds the answer as the engine's."""
    tokenizer = Tokenizer.from_folder(model)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    want = Engine(model=model).generate([tokenizer.encode_chat(messages)], params)[0]
    body = {"messages": messages, "max_completion_tokens": 7, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert (answer["choices"][0]["message"]["content"], answer["choices"][0]["finish_reason"]) == (want.text, "length")
    assert answer["usage"]["completion_tokens"] == 7


def _streamed(url: str, body: dict) -> tuple[str, str | None]:
    text, reason = "", None
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
    return text, reason
