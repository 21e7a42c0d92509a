"""`pdserve study`: its topologies and headline ratios, and the command end to end on `tiny` with a
handful of short requests (real workers, router and `pdserve bench`; its figures are the host's)."""

from __future__ import annotations

import json

import pytest

from benchmarks.pd_study import goodput_by_tpot, summarize, topologies
from router.cli import main


def test_topologies_of_two_and_four_workers():
    two = topologies(2, 256)
    assert [(t.name, t.mode, t.num_prefill, t.num_decode, t.max_num_batched_tokens, t.local_prefill_tokens)
            for t in two] == [("colocated", "colocated", 0, 2, 2048, 0),
                              ("colocated, chunked prefill (256)", "colocated", 0, 2, 256, 0),
                              ("disaggregated 1:1", "disaggregated", 1, 1, 2048, 0),
                              ("disaggregated 1:1, cost model", "disaggregated", 1, 1, 2048, None)]
    assert [t.name for t in topologies(4, 128, ("split",))] == [
        "disaggregated 1:3", "disaggregated 2:2", "disaggregated 3:1"]
    with pytest.raises(ValueError, match="at least 2 workers"):
        topologies(1, 256)
    with pytest.raises(ValueError, match="unknown topology kinds"):
        topologies(2, 256, ("colocated", "pipelined"))


def test_summary_picks_the_best_split_by_goodput():
    def result(name, goodput, p99_itl, p99_tpot=100.0):
        return {"topology": name, "request_goodput": goodput, "p99_itl_ms": p99_itl, "p99_tpot_ms": p99_tpot}

    summary = summarize([result("colocated", 0.1, 2000.0, 300.0), result("disaggregated 1:3", 0.2, 150.0),
                         result("disaggregated 2:2", 0.4, 100.0, 60.0), result("disaggregated 3:1", 0.4, 120.0),
                         result("disaggregated 2:2, cost model", 0.9, 10.0)])
    assert summary == {"best_split": "disaggregated 2:2", "one_to_one": "disaggregated 1:3",
                       "p99_itl_colocated_over_disaggregated": pytest.approx(20.0),
                       "goodput_disaggregated_over_colocated": pytest.approx(4.0),
                       "p99_tpot_colocated_over_disaggregated": pytest.approx(5.0)}
    # A colocated goodput of 0: the ratio is undefined, not infinite.
    assert summarize([result("colocated", 0.0, 1.0), result("disaggregated 1:1", 0.5, 1.0)])[
        "goodput_disaggregated_over_colocated"] is None


def test_goodput_at_several_tpot_objectives():
    # TPOTs: (1.0 - 0.2) / 4 = 200 ms, (0.5 - 0.1) / 8 = 50 ms, a one-token request (0), and a failure.
    result = {"duration": 2.0, "ttfts": [0.2, 0.1, 0.3, 0.0], "e2els": [1.0, 0.5, 0.3, 0.0],
              "output_lens": [5, 9, 1, 0], "errors": ["", "", "", "HTTP 500"]}
    assert goodput_by_tpot(result, [40, 50, 199, 200]) == {"40": 0.5, "50": 1.0, "199": 1.0, "200": 1.5}


def test_study_on_tiny(tmp_path, capsys):
    out = tmp_path / "study"
    main(["study", "--model", "tiny", "--prompt-len", "24", "--output-len", "4", "--num-prompts", "3",
          "--request-rate", "20", "40", "--topologies", "colocated", "split", "--tpot-slo", "60000", "--out", str(out)])
    report = json.loads((out / "study.json").read_text())
    assert [(r["topology"], r["request_rate"]) for r in report["results"]] == [
        ("colocated", 20), ("colocated", 40), ("disaggregated 1:1", 20), ("disaggregated 1:1", 40)]
    for r in report["results"]:
        assert (r["completed"], r["failed"], r["total_output_tokens"]) == (3, 0, 12)
        assert r["total_input_tokens"] >= 3 * 24  # the server counts its BOS, where the model has one
        assert r["request_goodput"] * r["duration"] == pytest.approx(3)  # a one-minute TPOT objective: all met
    assert report["summary"]["20"]["best_split"] == report["summary"]["40"]["best_split"] == "disaggregated 1:1"
    assert list(report["results"][0]["goodput_by_tpot_objective"]) == ["30000", "45000", "60000", "90000", "120000"]
    assert report["workload"]["prompt_len"] == 24
    for name in ("study-rate20.png", "study-rate40.png", "study-rates.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "disaggregated 1:1" in printed and "goodput_disaggregated_over_colocated" in printed
