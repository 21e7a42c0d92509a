"""The prompts `pdserve bench` sends, as vLLM's `bench serve` draws them: `random` (token ids of
lengths drawn uniformly in [len * (1 - ratio), len * (1 + ratio)]), `sharegpt` (the first human turn of
each conversation, the reply's length as the output length) and `jsonl` (one {"prompt": ...} a line).

Lengths in tokens are counted by the server (`POST /tokenize`, which pdserve and vLLM both answer), so
the client needs no tokenizer of its own.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (the random dataset on /v1/completions)
    prompt_len: int
    expected_output_len: int


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    rng: random.Random) -> list[SampleRequest]:
    """Random token ids (ids below 4 are special in pdserve's presets and are avoided)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--random-input-len and --random-output-len must be at least 1, got {input_len}, "
                         f"{output_len}")

    def draw(length: int) -> int:
        return rng.randint(max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio))))

    requests = []
    for _ in range(num_prompts):
        prompt_len, out_len = draw(input_len), draw(output_len)
        requests.append(SampleRequest([rng.randrange(4, vocab_size) for _ in range(prompt_len)], prompt_len, out_len))
    return requests


def sharegpt_requests(path: str | Path, num_prompts: int, output_len: int | None, count_tokens: Callable[[str], int],
                      rng: random.Random) -> list[SampleRequest]:
    """ShareGPT's JSON (a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}):
    shuffled, conversations of fewer than two turns skipped; the reply's token count is the output length
    unless `output_len` is given. Like vLLM, prompts under 4 tokens and replies under 4 are skipped."""
    data = _read_json(path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    rng.shuffle(data)
    requests = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not turns or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        prompt_len = count_tokens(prompt)
        out_len = output_len if output_len is not None else count_tokens(reply)
        if prompt_len < 4 or out_len < 4:
            continue
        requests.append(SampleRequest(prompt, prompt_len, out_len))
        if len(requests) == num_prompts:
            return requests
    raise ValueError(f"{path}: only {len(requests)} usable conversations, --num-prompts asks for {num_prompts}")


def jsonl_requests(path: str | Path, num_prompts: int, output_len: int | None, count_tokens: Callable[[str], int]
                   ) -> list[SampleRequest]:
    """One JSON object a line with "prompt" (text) and optionally "output_tokens"; the first `num_prompts`
    lines (cycled when the file is shorter)."""
    lines = [line for line in _read_text(path).splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no lines")
    requests = []
    for number, line in enumerate(lines[:num_prompts], start=1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line needs a \"prompt\" string")
        out_len = output_len if output_len is not None else entry.get("output_tokens", 256)
        if not isinstance(out_len, int) or out_len < 1:
            raise ValueError(f"{path}:{number}: \"output_tokens\" must be a positive integer, got {out_len!r}")
        requests.append(SampleRequest(entry["prompt"], count_tokens(entry["prompt"]), out_len))
    while len(requests) < num_prompts:
        requests.append(requests[len(requests) % len(lines)])
    return requests


def _read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"--dataset-path {path}: {error.strerror or error}") from None


def _read_json(path: str | Path):
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as error:
        raise ValueError(f"--dataset-path {path}: not JSON ({error})") from None
