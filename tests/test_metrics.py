"""Worker reports become Prometheus series with vLLM's names under the pdserve: prefix."""

from __future__ import annotations

from prometheus_client import generate_latest

from services.metrics import Metrics
from services.protocol import WorkerStats


def stats(**overrides) -> WorkerStats:
    base = dict(worker_id="decode-0", role="decode", node_id="n", num_running=3, num_waiting=1, num_kv_blocks=100,
                num_free_kv_blocks=75, num_tokens_processed=10, num_prefix_queries=64, num_prefix_hits=32,
                num_steps=5, kv_transfers=((0.002, 4096), (0.004, 8192)), kv_transfer_failures=1)
    return WorkerStats(**{**base, **overrides})


def sample(metrics: Metrics, name: str, labels: dict | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {})


def test_worker_report_sets_gauges_and_increments_counters_by_the_delta():
    m = Metrics()
    m.record_worker(stats())
    assert sample(m, "pdserve:num_requests_running", {"worker": "decode-0"}) == 3
    assert sample(m, "pdserve:kv_cache_usage_perc", {"worker": "decode-0"}) == 0.25
    assert sample(m, "pdserve:prefix_cache_hits_total", {"worker": "decode-0"}) == 32
    assert sample(m, "pdserve:kv_transfer_bytes_count") == 2 and sample(m, "pdserve:kv_transfer_bytes_sum") == 12288
    assert sample(m, "pdserve:kv_transfer_failures_total") == 1
    m.record_worker(stats(num_prefix_hits=40, kv_transfers=(), kv_transfer_failures=1))
    assert sample(m, "pdserve:prefix_cache_hits_total", {"worker": "decode-0"}) == 40
    assert sample(m, "pdserve:kv_transfer_failures_total") == 1
    # The exposition carries these values as samples (HELP/TYPE lines alone would not do).
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in generate_latest(m.registry).decode().splitlines() if not line.startswith("#")}
    assert samples['pdserve:prefix_cache_hits_total{worker="decode-0"}'] == 40
    assert samples["pdserve:kv_transfer_bytes_count"] == 2 and samples["pdserve:kv_transfer_failures_total"] == 1
    assert samples['pdserve:kv_transfer_bytes_bucket{le="4096.0"}'] == 1
    assert samples["pdserve:time_to_first_token_seconds_count"] == 0  # the router's own: nothing observed here


def test_efficiency_gauges_are_rates_over_the_window_since_the_last_report():
    m = Metrics()
    w = {"worker": "decode-0"}
    peaks = dict(peak_flops=1e12, peak_bytes_per_second=20e9)
    m.record_worker(stats(prefill_flops=4e11, prefill_seconds=1.0, decode_bytes=10e9, decode_seconds=1.0, **peaks))
    assert sample(m, "pdserve:prefill_flops_per_second", w) == 4e11
    assert sample(m, "pdserve:prefill_flops_utilization", w) == 0.4
    assert sample(m, "pdserve:decode_bandwidth_utilization", w) == 0.5
    assert sample(m, "pdserve:peak_bytes_per_second", w) == 20e9
    # Next window: 3e11 more FLOPs in 0.5 s of prefill (6e11 FLOP/s); no decode ran: its gauges stay.
    m.record_worker(stats(prefill_flops=7e11, prefill_seconds=1.5, decode_bytes=10e9, decode_seconds=1.0, **peaks))
    assert sample(m, "pdserve:prefill_flops_per_second", w) == 6e11
    assert sample(m, "pdserve:prefill_flops_utilization", w) == 0.6
    assert sample(m, "pdserve:decode_bytes_per_second", w) == 10e9


def test_queue_times_reported_by_workers_are_observed():
    m = Metrics()
    m.record_worker(stats(queue_times=(0.002, 0.25)))
    assert sample(m, "pdserve:request_queue_time_seconds_count") == 2
    assert sample(m, "pdserve:request_queue_time_seconds_sum") == 0.252
