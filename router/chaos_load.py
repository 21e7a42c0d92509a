"""`pdserve chaos`'s load: seeded request bodies (greedy and sampled, n > 1, short and long prompts),
each streamed with the token ids of every choice, and how a stream differs from an undisturbed one."""

from __future__ import annotations

import difflib
import json
import random
from dataclasses import dataclass

import httpx

# A failure is honest when its status says what happened: overload or no worker (429, 503: with
# Retry-After), or the deadline (504). A mid-stream error event carries the same codes.
HONEST_CODES = (429, 503, 504)
CONNECTION = "connection"  # the router's connection broke with no status (its process died)
TRUNCATED = "truncated"  # a 200 stream that ended without [DONE] and without an error event


@dataclass(frozen=True)
class Outcome:
    """One request's end: status 200 with every choice's token ids, or a failure."""

    status: int | str  # an HTTP status, an SSE error event's code, CONNECTION or TRUNCATED
    tokens: tuple[tuple[int, ...], ...] | None = None  # per choice, in index order (completed only)
    honest: bool = True
    cut: bool = False  # a router died under it and it was sent again to another

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.tokens is not None


def make_bodies(seed: int, count: int, vocab_size: int, model: str, long_tokens: int = 160) -> list[dict]:
    """`count` distinct completion bodies from `seed`: every fourth greedy, the others sampled with a
    seed (the undisturbed run must be the same stream), a third with n = 2, a fifth with a long prompt."""
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        prompt_len = rng.randrange(long_tokens // 2, long_tokens) if i % 5 == 4 else rng.randrange(3, 12)
        body = {"model": model, "prompt": [rng.randrange(3, vocab_size) for _ in range(prompt_len)],
                "max_tokens": rng.randrange(24, 200), "ignore_eos": True, "stream": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        if i % 4 == 0:
            body["temperature"] = 0.0
        else:
            body |= {"temperature": 0.9, "top_p": 0.95, "seed": rng.randrange(1 << 31)}
        if i % 3 == 2:
            body["n"] = 2
        bodies.append(body)
    return bodies


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    """Send `body` to the router at `url` and read its stream to the end. A broken connection is
    raised (httpx.TransportError): the caller decides whether a router died."""
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            code = response.status_code
            honest = code in HONEST_CODES and (code == 504 or "retry-after" in response.headers)
            return Outcome(code, honest=honest)
        tokens: dict[int, list[int]] = {}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return Outcome(200, tuple(tuple(tokens.get(i, ())) for i in range(body.get("n", 1))))
            chunk = json.loads(line[6:])
            if "error" in chunk:
                code = chunk["error"].get("code")
                return Outcome(code, honest=code in HONEST_CODES)
            for choice in chunk["choices"]:
                names = (choice.get("logprobs") or {}).get("tokens") or []
                tokens.setdefault(choice["index"], []).extend(int(n.removeprefix("token_id:")) for n in names)
    return Outcome(TRUNCATED, honest=False)


def differences(want: tuple[tuple[int, ...], ...], got: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
    """(duplicated, missing) tokens of `got` against the undisturbed `want`, over every choice: tokens
    `got` has in excess count as duplicated, tokens it lacks as missing (a replaced token is both)."""
    duplicated = missing = 0
    for a, b in zip(want, got):
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if op in ("delete", "replace"):
                missing += i2 - i1
            if op in ("insert", "replace"):
                duplicated += j2 - j1
    return duplicated, missing
