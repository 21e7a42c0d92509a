"""`pdserve roofline`: the prefill fit and the stall arithmetic on synthetic points, and the command
end to end on the `tiny` preset with very small sizes (its figures are not checked: they are the host's)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.roofline_probe import Point, fit_prefill, formula_crossover
from benchmarks.roofline_report import stalls
from router.cli import main


def test_fit_recovers_linear_and_quadratic_terms():
    a, b, c = 0.01, 2e-4, 1e-7  # the quadratic term equals the linear one at L = b / c = 2000
    points = [Point(n, a + b * n + c * n * n, 0, 1) for n in (128, 256, 512, 1024, 2048, 4096)]
    fit = fit_prefill(points)
    assert fit["intercept_s"] == pytest.approx(a)
    assert fit["linear_s_per_token"] == pytest.approx(b)
    assert fit["quadratic_s_per_token2"] == pytest.approx(c)
    assert fit["attention_crossover_tokens"] == pytest.approx(2000)
    assert fit["rms_residual_s"] == pytest.approx(0, abs=1e-9)
    linear = fit_prefill([Point(n, 1e-3 * n, 0, 1) for n in (10, 20, 40, 80)])
    assert linear["quadratic_s_per_token2"] == pytest.approx(0, abs=1e-12)


def test_formula_crossover_is_where_attention_flops_equal_matmul_flops():
    cost = SimpleNamespace(layer_matmul_params=1000, attention_flops_per_pair=8)
    crossover = formula_crossover(cost)
    assert crossover == 500
    # At L = 500: attention 8 * L^2 / 2 = 1,000,000 FLOPs, matmuls 2 * 1000 * L = 1,000,000 FLOPs.
    assert 8 * crossover**2 / 2 == 2 * 1000 * crossover


def test_stalls_from_step_times():
    prefill = [Point(128, 0.2, 0, 1), Point(256, 0.4, 0, 1), Point(1024, 2.0, 0, 1)]
    decode = [Point(1, 0.05, 0, 1), Point(8, 0.08, 0, 1)]
    got = stalls(prefill, decode, decode_batch=8, chunk_size=256)
    assert got["decode_step_s"] == 0.08
    rows = {r["prompt_len"]: r for r in got["rows"]}
    assert set(rows) == {256, 1024}  # prompts shorter than a chunk are not chunked: left out
    assert rows[1024]["colocated_s"] == pytest.approx(2.08)
    assert rows[1024]["chunked_s"] == pytest.approx(0.48) and rows[1024]["chunked_steps"] == 4
    assert rows[1024]["disaggregated_s"] == 0.08
    assert rows[1024]["colocated_over_disaggregated"] == pytest.approx(26.0)


def test_roofline_command_on_tiny(tmp_path, capsys):
    out = tmp_path / "roof"
    main(["roofline", "--model", "tiny", "--out", str(out), "--lengths", "16", "32", "48", "--batches", "1", "2",
          "--context", "16", "--prefill-len", "8", "--chunk-size", "16", "--decode-batch", "2", "--steps", "2",
          "--repeats", "1"])
    report = json.loads((out / "roofline.json").read_text())
    assert [p["size"] for p in report["prefill_vs_length"]["points"]] == [16, 32, 48]
    assert [p["size"] for p in report["batching"]["decode"]] == [1, 2]
    assert [p["size"] for p in report["batching"]["prefill"]] == [1, 2]
    cost = report["cost_model"]
    # The work of each point is the live gauges' formula (services/roofline.py): a decode step of
    # batch 2 reads every weight once plus the KV of both contexts.
    d2 = report["batching"]["decode"][1]
    assert cost["weight_bytes"] < d2["bytes"] < cost["weight_bytes"] + 2 * 32 * cost["kv_bytes_per_token"]
    assert report["prefill_vs_length"]["points"][0]["flops"] == (
        2 * cost["layer_matmul_params"] * 16 + 2 * cost["lm_head_params"] + cost["attention_flops_per_pair"] * 16 * 17 // 2)
    ceilings = report["ceilings"]
    assert ceilings["ridge_flops_per_byte"] == pytest.approx(ceilings["flops_per_second"] / ceilings["bytes_per_second"])
    assert [r["prompt_len"] for r in report["disaggregation"]["rows"]] == [16, 32, 48]
    for name in ("prefill_vs_length.png", "batching.png", "disaggregation.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "attention matters from" in capsys.readouterr().out


def test_roofline_flags_are_checked(tmp_path, capsys):
    for flags, needle in ((["--decode-batch", "3", "--batches", "1", "2"], "--decode-batch 3"),
                          (["--lengths", "16", "--chunk-size", "64"], "--chunk-size 64"),
                          (["--lengths", "100000"], "the model has")):
        with pytest.raises(SystemExit):
            main(["roofline", "--model", "tiny", "--out", str(tmp_path), *flags])
        assert needle in capsys.readouterr().err
