"""`pdserve chaos`: its stream comparison and failure classification (unit), and one short round of
the real command (a simulated multi-node cluster, router processes, crashes) whose streams must all
equal the undisturbed run, with nothing leaked and every failure an honest status."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from router.chaos import fault_kinds
from router.chaos_load import TRUNCATED, differences, make_bodies, stream


def test_differences_count_repeated_and_lost_tokens_per_choice():
    want = ((1, 2, 3, 4, 5), (7, 8))
    assert differences(want, want) == (0, 0)
    assert differences(want, ((1, 2, 3, 3, 4, 5), (7, 8))) == (1, 0)  # a token sent twice
    assert differences(want, ((1, 2, 4, 5), (7,))) == (0, 2)  # one lost in each choice
    assert differences(want, ((1, 2, 9, 4, 5), (7, 8))) == (1, 1)  # a different token: both


def test_bodies_mix_greedy_seeded_sampling_n2_and_long_prompts():
    bodies = make_bodies(seed=3, count=20, vocab_size=500, model="m", long_tokens=160)
    assert bodies == make_bodies(seed=3, count=20, vocab_size=500, model="m", long_tokens=160)
    greedy = [b for b in bodies if b["temperature"] == 0.0]
    sampled = [b for b in bodies if b["temperature"] > 0]
    assert len(greedy) == 5 and len(sampled) == 15 and all("seed" in b for b in sampled)
    assert sum(b.get("n", 1) == 2 for b in bodies) == 6
    assert sum(len(b["prompt"]) >= 80 for b in bodies) == 4  # every fifth is long
    assert all(b["stream"] and b["ignore_eos"] and b["return_tokens_as_token_ids"] for b in bodies)
    assert all(3 <= t < 500 for b in bodies for t in b["prompt"])


def test_fault_kinds_refuse_an_unknown_name():
    assert fault_kinds("decode, router") == ("decode", "router")
    with pytest.raises(argparse.ArgumentTypeError, match="'decode,meteor'"):
        fault_kinds("decode,meteor")


def _answer(*responses: httpx.Response):
    async def run():
        transport = httpx.MockTransport(lambda request: responses[0])
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream(client, "http://router", {"n": 2})
    return asyncio.run(run())


def test_a_failure_is_honest_only_with_its_status_and_retry_after():
    assert _answer(httpx.Response(503, headers={"Retry-After": "1"}, json={})).honest
    assert not _answer(httpx.Response(503, json={})).honest  # no Retry-After
    assert _answer(httpx.Response(504, json={})).honest
    assert not _answer(httpx.Response(500, json={})).honest
    events = ('data: {"choices": [{"index": 1, "logprobs": {"tokens": ["token_id:7"]}}]}\n\n'
              'data: {"choices": [{"index": 0, "logprobs": {"tokens": ["token_id:5", "token_id:6"]}}]}\n\n')
    done = _answer(httpx.Response(200, text=events + "data: [DONE]\n\n"))
    assert done.completed and done.tokens == ((5, 6), (7,))
    error = _answer(httpx.Response(200, text=events + 'data: {"error": {"code": 503}}\n\ndata: [DONE]\n\n'))
    assert (error.status, error.honest) == (503, True)
    assert _answer(httpx.Response(200, text=events + 'data: {"error": {"code": 500}}\n\n')).honest is False
    cut = _answer(httpx.Response(200, text=events))
    assert (cut.status, cut.honest, cut.completed) == (TRUNCATED, False, False)


def test_a_short_chaos_round_loses_repeats_and_leaks_nothing(tiny_path, tmp_path):
    out = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "router.cli", "chaos", "--model", str(tiny_path), "--duration", "3",
                           "--faults", "decode,router,all-decode", "--fault-gap", "1", "--concurrency", "4",
                           "--result-json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [f["kind"] for f in result["faults"]] == ["decode", "router", "all-decode"]
    assert all(f["recovered_s"] is not None for f in result["faults"]), result["faults"]
    assert result["completed"] > 0 and result["sent"] == result["completed"] + sum(result["failed"].values())
    assert (result["duplicated_tokens"], result["missing_tokens"], result["streams_differing"]) == (0, 0, 0)
    assert result["streams_unchecked"] == 0
    # On a leak the command's stderr lists the objects left in the store, with where each was made: all of that
    # listing (a 1-byte leak has recurred, rarely, and its maker was in the listing's cut-off head)
    listing = done.stderr[max(0, done.stderr.find("objects left in the store")):]
    assert (result["leaked_kv_blocks"], result["leaked_object_bytes"]) == (0, 0), listing[:40000]
    assert result["failed_without_honest_status"] == 0 and set(result["failed"]) <= {"429", "503", "504"}
    for key in ("sent", "completed", "failed", "duplicated_tokens", "missing_tokens", "leaked_kv_blocks",
                "leaked_object_bytes", "faults"):
        assert f"\n{key}: " in "\n" + done.stdout, key
