"""What /v1/completions and /detokenize take and give at their edges, through a real router on the
split path: token ids are strict integers in range; `max_tokens: 0` with `echo` scores the prompt on
the prefill worker alone (as lm-evaluation-harness asks vLLM to); `text_offset` indexes the returned
text exactly."""

from __future__ import annotations

import e2e_checks as checks
import httpx
import pytest
import ray
from cluster_harness import router_server, serve_router, two_node_cluster, wait_for

from router.launcher import ClusterSpec
from router.text_offsets import TextOffsets
from services import Engine, SamplingParams
from services.protocol import PrefillRequest
from services.tokenizer import Tokenizer

SCORED = [1] + [60 + (11 * i) % 400 for i in range(40)]


@pytest.fixture(scope="module")
def server(tiny_path):
    with two_node_cluster():
        # Known ceilings given: the workers skip their start-up probe.
        spec = ClusterSpec(model=str(tiny_path), namespace="pd-edges", peak_flops=2e12, peak_bytes_per_second=5e10,
                           engine_options={"num_threads": 1, "max_num_seqs": 8})
        with router_server(spec) as (url, actors, _):
            yield url, actors, str(tiny_path), spec


CHAT = [{"role": "user", "content": "hi"}]
BAD_TOKEN_IDS = [
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 5], [6, True]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 5.0]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 5}}, "logit_bias"),  # "²".isdigit()
    ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [False]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"-1": 5}}, "logit_bias"),
    ("/detokenize", {"tokens": [True, 5]}, "tokens"),
    ("/detokenize", {"tokens": [5, 99999]}, "tokens"),
]


def test_token_ids_are_strict_integers_in_range(server):
    url, *_ = server
    for path, body, param in BAD_TOKEN_IDS:
        response = httpx.post(url + path, json={"max_tokens": 2, **body}, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"] == {"message": response.json()["error"]["message"], "param": param,
                                            "type": "BadRequestError", "code": 400}, body
    message = httpx.post(url + "/v1/completions", json={"prompt": [[False]]}).json()["error"]["message"]
    assert "true and false are not" in message
    # ...while the same shapes with integers are served
    assert httpx.post(url + "/detokenize", json={"tokens": [1, 5]}).status_code == 200
    for body in ({"prompt": [[1, 5], [6, 7]]}, {"prompt": "hi", "stop_token_ids": [3], "logit_bias": {"5": 1}}):
        assert httpx.post(url + "/v1/completions", json={"max_tokens": 2, **body}, timeout=60).status_code == 200


def test_max_tokens_0_without_echo_is_refused_naming_why(server):
    url, *_ = server
    for body, param, words in (({"prompt": "hi", "max_tokens": 0}, "max_tokens", "only with echo"),
                               ({"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens",
                                "max_tokens (0)")):
        response = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert words in response.json()["error"]["message"]


def test_max_tokens_0_with_echo_scores_the_prompt_on_the_prefill_worker_alone(server):
    url, (prefill, decode), model, _ = server
    want = Engine(model=model).generate([SCORED], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    tokenizer = Tokenizer.from_folder(model)
    ray.get(decode.stats.remote("scoring"))  # from here on, the KV transfers it receives are kept for this reader
    before = ray.get(decode.stats.remote("scoring"))

    body = checks.completion(url, SCORED, 0, echo=True, logprobs=2, return_tokens_as_token_ids=True)
    (choice,) = body["choices"]
    assert choice["text"] == tokenizer.decode(SCORED) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in SCORED]  # the prompt's, and no generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # float32 sums in another batch shape: equal to ~1e-5 of values near -10
    assert lp["token_logprobs"][1:] == pytest.approx([e[t] for t, e in zip(SCORED[1:], want.prompt_logprobs)],
                                                     abs=1e-4)
    assert lp["top_logprobs"][1:] == [pytest.approx({f"token_id:{k}": v for k, v in e.items()}, abs=1e-4)
                                      for e in want.prompt_logprobs]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (41, 0, 41)

    text, chunks = checks.streamed_text(url, SCORED, 0, echo=True, logprobs=2, return_tokens_as_token_ids=True)
    assert text == choice["text"]
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    plain = checks.completion(url, SCORED, 0, echo=True)["choices"][0]  # echo alone: the prompt back
    assert (plain["text"], plain["logprobs"]) == (choice["text"], None)

    # Nothing went to the decode worker, and nothing is left behind on the prefill worker.
    after = ray.get(decode.stats.remote("scoring"))
    assert (after.num_steps, after.num_tokens_processed, after.kv_transfers) == (
        before.num_steps, before.num_tokens_processed, ())
    wait_for(lambda: (s := ray.get(prefill.stats.remote())).num_running == 0 and s.num_free_kv_blocks ==
             s.num_kv_blocks, "the prefill worker kept a scored prompt's blocks")


def test_a_prompt_scored_where_its_decode_worker_prefills_is_the_same(server):
    """Prefilled by the decode worker (colocated mode, and short prompts with --local-prefill-tokens):
    the token that worker samples is dropped there too, and its blocks are freed."""
    url, (_, decode), _, spec = server
    want = checks.completion(url, SCORED, 0, echo=True, logprobs=2)
    computed = ray.get(decode.stats.remote()).num_tokens_processed
    with serve_router(spec, local_prefill_tokens=4096) as (local_url, _):
        got = checks.completion(local_url, SCORED, 0, echo=True, logprobs=2)
    assert ray.get(decode.stats.remote()).num_tokens_processed >= computed + len(SCORED)  # it did run there
    assert got["usage"]["completion_tokens"] == 0 and got["choices"][0]["text"] == want["choices"][0]["text"]
    lp, expected = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert (lp["tokens"], lp["text_offset"]) == (expected["tokens"], expected["text_offset"])
    assert lp["token_logprobs"][1:] == pytest.approx(expected["token_logprobs"][1:], abs=1e-4)
    checks.wait_until_idle([decode])


def test_a_one_token_prefill_exports_no_kv(server):
    """The prefill call's stream: metadata then KV, but for a request that ends at its first token
    (a scored prompt is one) the KV would go nowhere, so there is none."""
    _, (prefill, _), *_ = server
    for max_tokens, items in ((1, 1), (2, 2)):
        stream = prefill.prefill.remote(PrefillRequest(f"kv-{max_tokens}", SCORED,
                                                       SamplingParams(max_tokens=max_tokens, temperature=0)))
        refs = list(stream)
        meta = ray.get(refs[0])
        assert (len(refs), meta.kv_bytes > 0) == (items, max_tokens > 1)


def _expected_offsets(tokenizer: Tokenizer, ids: list[int], text: str, start: int) -> list[int]:
    """For text whose every character is whole (valid UTF-8, as here): a token begins where the
    decode of the tokens before it stops agreeing with the text."""
    offsets = []
    for i in range(len(ids)):
        before = tokenizer.decode(ids[:i])
        same = next((n for n, (a, b) in enumerate(zip(before, text)) if a != b), min(len(before), len(text)))
        offsets.append(start + same)
    return offsets


def test_text_offset_indexes_the_returned_text(server):
    """Offsets into the text returned, whatever the tokens' own strings: the BOS token that the echo
    skips ("<|begin_of_text|>", 17 characters) and characters split over byte tokens move nothing."""
    url, _, model, _ = server
    tokenizer = Tokenizer.from_folder(model)
    prompt = "Café 🙂 naïve 日本語, São Paulo!"
    ids = tokenizer.encode(prompt)
    assert ids[0] == 0 and any(tokenizer.token_text(t) == "\ufffd" for t in ids)  # BOS, and split characters
    body = checks.completion(url, prompt, 12, echo=True, logprobs=1, return_tokens_as_token_ids=True)
    choice = body["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    returned = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert returned[:len(ids)] == ids
    echo = tokenizer.decode(ids)
    assert text.startswith(echo) and echo == prompt
    assert lp["text_offset"][:len(ids)] == _expected_offsets(tokenizer, ids, echo, 0)
    output = returned[len(ids):]
    assert len(output) == 12 and text[len(echo):] == tokenizer.decode(output)
    offsets = lp["text_offset"][len(ids):]
    assert offsets == TextOffsets(tokenizer, True, len(echo)).push(output, len(text))
    for token_id, offset in zip(returned, lp["text_offset"]):  # a whole token's text is where it says
        piece = tokenizer.decode([token_id])
        if "\ufffd" not in piece:
            assert text[offset:offset + len(piece)] == piece, (token_id, offset)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(text)
    _, chunks = checks.streamed_text(url, prompt, 12, echo=True, logprobs=1, return_tokens_as_token_ids=True)
    assert [o for c in chunks if c["choices"] for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]


def _byte_token(tokenizer: Tokenizer, byte: int) -> int:
    """The id of the byte-level token for one byte (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char = chr(byte) if byte in printable else chr(256 + [b for b in range(256) if b not in printable].index(byte))
    return tokenizer._hf.token_to_id(char)


@pytest.mark.parametrize(("pieces", "offsets"), [
    ([0xE6, 0x97, 0xA5, "b"], [0, 0, 0, 1]),  # 日 in three byte tokens: each points at 日
    ([0xE6, "a"], [0, 1]),  # a lone lead byte, ended by "a": one U+FFFD, then "a"
    ([0xE6, 0xE6, 0x97, 0xA5], [0, 1, 1, 1]),  # a lone lead byte, then 日
    (["<bos>", 0xE6, "<bos>", 0x97, 0xA5, "x"], [0, 0, 0, 0, 0, 1]),  # skipped specials inside a character
    (["a", "<bos>", "c"], [0, 1, 1]),
])
def test_text_offsets_of_split_characters_and_skipped_tokens(tiny_path, pieces, offsets):
    tokenizer = Tokenizer.from_folder(tiny_path)
    ids = [0 if p == "<bos>" else _byte_token(tokenizer, p) if isinstance(p, int) else tokenizer.encode(p, False)[0]
           for p in pieces]
    assert TextOffsets(tokenizer, True, 5).push(ids, 99) == [5 + o for o in offsets]
    one_by_one = TextOffsets(tokenizer, True)
    assert [o for t in ids for o in one_by_one.push([t], 99)] == offsets  # as a stream sees them
    assert TextOffsets(tokenizer, True).push(ids, 1) == [min(o, 1) for o in offsets]  # none past the text
