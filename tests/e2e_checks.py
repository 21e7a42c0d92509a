"""End-to-end checks shared by the disaggregated and colocated test modules: greedy HTTP output
(streamed and not) equals the single-engine output, and so do the openai client's answers and
concurrent streams; a client disconnect frees the decode worker's KV."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
import ray
from cluster_harness import step_delay, wait_for

from services import Engine, SamplingParams
from services.tokenizer import Tokenizer

# Block size is 16: shorter than one block, exactly one block, many blocks.
PROMPT_LENGTHS = (5, 16, 100)


def prompts(vocab_low: int, vocab_high: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[1] + [rng.randrange(vocab_low, vocab_high) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


def completion(url: str, prompt, max_tokens: int, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def chunks(response: httpx.Response):
    """The JSON chunks of a streamed completion, each checked not to be an error event."""
    for line in response.iter_lines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            yield chunk


def streamed_text(url: str, prompt, max_tokens: int, **extra) -> tuple[str, list[dict]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks


def check_greedy_matches_engine(url: str, model: str, token_prompts: list[list[int]], tokenizer) -> None:
    """Fresh prompts (nothing cached for them yet): each answer is the single engine's, and a repeat
    of a prompt is served from the prefix cache as the single engine's repeat is."""
    engine = Engine(model=model)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(token_prompts, params)]
    cached_on_repeat = [o.num_cached_tokens for o in engine.generate(token_prompts, params)]
    assert cached_on_repeat == [(len(p) - 1) // 16 * 16 for p in token_prompts]  # whole blocks, the last token left
    for prompt, expected, cached in zip(token_prompts, want, cached_on_repeat):
        for cached_tokens in (0, cached):  # first sent, then repeated
            body = completion(url, prompt, 20, logprobs=0)
            choice = body["choices"][0]
            assert choice["finish_reason"] == "length"
            assert choice["text"] == tokenizer.decode(expected)
            assert len(choice["logprobs"]["tokens"]) == 20
            assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 20, "total_tokens":
                                     len(prompt) + 20, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        text, chunks = streamed_text(url, prompt, 20)
        assert text == choice["text"]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]].count("length") == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


def check_openai_client(url: str, model_name: str, model: str) -> None:
    """The openai package against the router: its answers (text and chat, streamed or not) are the
    single engine's for the same prompt and parameters."""
    engine = Engine(model=model)
    tokenizer = Tokenizer.from_folder(model)
    messages = [{"role": "user", "content": "Tell me a story."}]
    want_text = engine.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))[0]
    want_chat = engine.generate([tokenizer.encode_chat(messages)], SamplingParams(max_tokens=10, temperature=0))[0]
    assert want_text.text and want_chat.text
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    c = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert (c.choices[0].text, c.choices[0].finish_reason) == (want_text.text, want_text.finish_reason)
    assert c.usage.completion_tokens == len(want_text.token_ids)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert streamed == want_text.text
    chat = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (want_chat.text,
                                                                                 want_chat.finish_reason)
    parts = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == want_chat.text
    try:
        client.completions.create(model=model_name, prompt="x", max_tokens=4, temperature=-1)
        raise AssertionError("temperature -1 was accepted")
    except openai.BadRequestError as error:
        assert error.status_code == 400 and error.body["param"] == "temperature"


def check_concurrent_streams(url: str, model: str, token_prompts: list[list[int]], num_streams: int = 32) -> None:
    """`num_streams` streams at once, each the single engine's text for its prompt."""
    prompts_ = [token_prompts[i % len(token_prompts)][: 3 + i] for i in range(num_streams)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.text for o in Engine(model=model).generate(prompts_, params)]

    async def run_all():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(p):
                body = {"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
                pieces = []
                async with client.stream("POST", url + "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            pieces.append(json.loads(line[6:])["choices"][0]["text"])
                return "".join(pieces)

            return await asyncio.gather(*(one(p) for p in prompts_))

    assert asyncio.run(run_all()) == want


# A sleep after every step on the workers while a disconnect check runs: the request can then not
# finish before the client leaves, nor before wait_until_idle gives up, however fast the host.
DISCONNECT_STEP_DELAY = 0.05  # 1,000 tokens take 50 s at least; wait_until_idle waits 15 s


def check_disconnect_frees_kv(url: str, decode_actors: list) -> None:
    body = {"prompt": [1] + list(range(10, 60)), "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    processed = sum(ray.get(a.stats.remote()).num_tokens_processed for a in decode_actors)
    with step_delay(decode_actors, DISCONNECT_STEP_DELAY):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert got
            busy = [ray.get(a.stats.remote()) for a in decode_actors]
            assert sum(s.num_running for s in busy) == 1 and any(s.num_free_kv_blocks < s.num_kv_blocks for s in busy)
        stats = wait_until_idle(decode_actors)  # it was aborted: it could not have finished by now
    assert sum(s.num_tokens_processed for s in stats) - processed < 1000


def check_non_streaming_disconnect_frees_kv(url: str, decode_actors: list) -> None:
    """A client that leaves while its non-streamed request decodes (seen running on a decode worker,
    holding blocks) gets it aborted there and the blocks freed."""
    body = json.dumps({"prompt": [1] + list(range(10, 60)), "max_tokens": 1000, "temperature": 0,
                       "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    processed = sum(ray.get(a.stats.remote()).num_tokens_processed for a in decode_actors)
    with step_delay(decode_actors, DISCONNECT_STEP_DELAY):
        with socket.create_connection((host, int(port))) as client:  # closed by hand, mid-request
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

            def decoding() -> bool:
                stats = [ray.get(a.stats.remote()) for a in decode_actors]
                return any(s.num_running == 1 and s.num_free_kv_blocks < s.num_kv_blocks for s in stats)

            wait_for(decoding, "the request never reached a decode worker")
        stats = wait_until_idle(decode_actors)  # it was aborted: it could not have finished by now
    done = sum(s.num_tokens_processed for s in stats) - processed
    assert 0 < done < 1000


def wait_until_idle(decode_actors: list) -> list:
    """Poll (bounded) until no decode worker runs a request or holds a KV block; returns their stats."""
    deadline = time.monotonic() + 15
    while True:
        stats = [ray.get(a.stats.remote()) for a in decode_actors]
        if all(s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == 0 for s in stats):
            return stats
        assert time.monotonic() < deadline, f"KV still held after the client left: {stats}"
        time.sleep(0.2)


def check_echo_logprobs_score_the_prompt(url: str, model: str) -> None:
    """`echo` + `logprobs` (how evaluation harnesses score text): the prompt's tokens with their
    logprobs (the first has none), then the output's, all equal to the single engine's; streamed,
    the first chunk carries the prompt's part."""
    prompt = [1] + [60 + (11 * i) % 400 for i in range(40)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    want = Engine(model=model).generate([prompt], params)[0]

    def named(entries: list[dict[int, float]]) -> list[dict[str, float]]:
        return [{f"token_id:{k}": v for k, v in lp.items()} for lp in entries]

    body = completion(url, prompt, 4, echo=True, logprobs=2, return_tokens_as_token_ids=True)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    everything = prompt + want.token_ids
    assert lp["tokens"] == [f"token_id:{t}" for t in everything]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [e[t] for t, e in zip(everything[1:], want.prompt_logprobs + want.logprobs)]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
    assert lp["top_logprobs"][1:] == [pytest.approx(e, abs=1e-5) for e in named(want.prompt_logprobs + want.logprobs)]
    tokenizer = Tokenizer.from_folder(model)
    assert choice["text"] == tokenizer.decode(prompt) + want.text
    _, chunks = streamed_text(url, prompt, 4, echo=True, logprobs=2, return_tokens_as_token_ids=True)
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def check_kv_fault_recomputed(decode, fault: str, prompt_len: int, max_tokens: int, ask, want) -> None:
    """The decode worker's next KV fetch `fault`s ("corrupt": one bit flipped, the checksum fails;
    "lose": fetched, then reported lost; test-only hooks), `ask()` sends the request: its answer is `want`,
    the router had the prompt recomputed once, and the decode worker computed exactly that."""
    from services.metrics import METRICS

    recomputes = METRICS.kv_recomputes._value.get()
    before = ray.get(decode.stats.remote())
    ray.get(decode.__ray_call__.remote(lambda self: setattr(self, "kv_fault", fault)))
    assert ask() == want
    assert METRICS.kv_recomputes._value.get() == recomputes + 1
    after = wait_until_idle([decode])[0]
    assert after.kv_transfer_failures == before.kv_transfer_failures + 1
    # Recomputed there: the prompt and the prefill's first token, then a token a step (a corrupt
    # KV was also copied in and its first token fed, in the step that waited for the failed check).
    wasted = 1 if fault == "corrupt" else 0
    assert after.num_tokens_processed - before.num_tokens_processed == wasted + prompt_len + 1 + max_tokens - 2
    assert ray.get(decode.__ray_call__.remote(lambda self: self.kv_fault)) is None  # it hit this request
