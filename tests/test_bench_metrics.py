"""pdserve bench's figures on a hand-computed example, its arrival schedule and its datasets (no server)."""

from __future__ import annotations

import json
import math
import random

import pytest

from benchmarks.serve_bench import arrival_offsets
from benchmarks.serve_dataset import jsonl_requests, random_requests, sharegpt_requests
from benchmarks.serve_metrics import calculate_metrics, parse_goodput, percentile_key
from benchmarks.serve_request import RequestOutput


def example() -> list[RequestOutput]:
    """Two requests that succeeded and one that failed, their timings in seconds."""
    return [
        RequestOutput(10, success=True, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2, output_tokens=4),
        RequestOutput(20, success=True, ttft=0.3, itl=[0.1], latency=0.4, output_tokens=2),
        RequestOutput(30, success=False, error="HTTP 500: boom"),
    ]


def test_metrics_of_the_hand_computed_example():
    m = calculate_metrics(example(), duration_s=2.0, goodput={"ttft": 250, "tpot": 50})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)  # the failed prompt is not counted
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    # Only the first request meets both objectives: TTFT 100 <= 250 and TPOT 33.3 <= 50 (the second: TTFT 300).
    assert m["request_goodput"] == pytest.approx(0.5)
    # TTFT 100, 300 ms.
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["std_ttft_ms"]) == pytest.approx((200, 200, 100))
    assert (m["p90_ttft_ms"], m["p99_ttft_ms"]) == pytest.approx((280, 298))
    # TPOT: (200 - 100) / 3 = 33.33 and (400 - 300) / 1 = 100 ms.
    assert m["mean_tpot_ms"] == pytest.approx(200 / 3)
    assert m["p99_tpot_ms"] == pytest.approx(100 / 3 + 0.99 * (100 - 100 / 3))
    # ITL: every gap of every request, 20 30 50 100 ms; p90 sits 0.7 of the way from 50 to 100.
    assert (m["mean_itl_ms"], m["median_itl_ms"]) == pytest.approx((50, 40))
    assert (m["p90_itl_ms"], m["p99_itl_ms"]) == pytest.approx((85, 98.5))
    assert (m["mean_e2el_ms"], m["p50_e2el_ms"], m["p99_e2el_ms"]) == pytest.approx((300, 300, 398))


def test_goodput_objectives_and_one_token_requests():
    outputs = example() + [RequestOutput(5, success=True, ttft=0.05, latency=0.05, output_tokens=1)]
    # A one-token request has no TPOT sample, and counts as TPOT 0 for goodput (vLLM's rule).
    m = calculate_metrics(outputs, duration_s=1.0, goodput={"tpot": 120})
    assert m["request_goodput"] == pytest.approx(3.0)
    assert m["median_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert calculate_metrics(outputs, duration_s=1.0)["request_goodput"] is None


def test_no_success_reports_zeros_not_errors():
    m = calculate_metrics([RequestOutput(3, error="x")], duration_s=1.0)
    assert (m["completed"], m["failed"], m["p99_itl_ms"], m["request_throughput"]) == (0, 1, 0.0, 0.0)


def test_percentile_keys_and_goodput_flag():
    assert percentile_key("itl", 99) == "p99_itl_ms"
    assert percentile_key("ttft", 99.9) == "p99.9_ttft_ms"
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in ("itl:5", "tpot", "tpot:fast", "tpot:0"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_arrival_schedule():
    offsets = arrival_offsets(50, 4.0, 1.0, seed=3)
    assert offsets == arrival_offsets(50, 4.0, 1.0, seed=3)
    assert offsets == sorted(offsets) and offsets[0] > 0
    assert offsets[-1] == pytest.approx(50 / 4.0)  # scaled to the configured rate, as vLLM does
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    regular = arrival_offsets(50, 4.0, 1000.0, seed=3)  # a large gamma shape: nearly constant gaps
    regular_gaps = [b - a for a, b in zip(regular, regular[1:])]
    assert max(regular_gaps) - min(regular_gaps) < max(gaps) - min(gaps)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_offsets(3, 0.0, 1.0, seed=0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, 0.0, seed=0)


def test_random_dataset_lengths():
    requests = random_requests(200, 100, 10, 0.5, vocab_size=300, rng=random.Random(0))
    assert all(50 <= r.prompt_len <= 150 and len(r.prompt) == r.prompt_len for r in requests)
    assert all(5 <= r.expected_output_len <= 15 for r in requests)
    assert {t for r in requests for t in r.prompt} <= set(range(4, 300))
    assert {r.prompt_len for r in random_requests(3, 7, 2, 0.0, 300, random.Random(1))} == {7}
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 10, 10, 1.0, 300, random.Random(0))


def test_file_datasets(tmp_path):
    count = lambda text: len(text.split())  # noqa: E731 - a stand-in for the server's /tokenize
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "a b c", "output_tokens": 7}\n{"prompt": "d e"}\n')
    got = jsonl_requests(lines, 3, None, count)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in got] == [
        ("a b c", 3, 7), ("d e", 2, 256), ("a b c", 3, 7)]
    lines.write_text('{"prompt": 5}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        jsonl_requests(lines, 1, None, count)
    share = tmp_path / "share.json"
    turn = lambda who, n: {"from": who, "value": " ".join(["w"] * n)}  # noqa: E731
    share.write_text(json.dumps([{"conversations": [turn("human", 5), turn("gpt", 9)]},
                                 {"conversations": [turn("human", 2), turn("gpt", 9)]},  # too short: skipped
                                 {"conversations": [turn("human", 6)]}]))
    got = sharegpt_requests(share, 1, None, count, random.Random(0))
    assert [(r.prompt_len, r.expected_output_len) for r in got] == [(5, 9)]
    with pytest.raises(ValueError, match="only 1 usable"):
        sharegpt_requests(share, 2, None, count, random.Random(0))
    with pytest.raises(ValueError, match="--dataset-path"):
        jsonl_requests(tmp_path / "missing.jsonl", 1, None, count)
