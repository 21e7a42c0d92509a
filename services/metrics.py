"""Every Prometheus metric pdserve exports, declared once (names and buckets follow vLLM's, with the
`pdserve:` prefix). The router records request-level figures itself and copies the workers' own
counters from their periodic `stats()` reports, so one scrape of the router sees everything."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets, so dashboards port with a rename.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
BYTES_BUCKETS = tuple(float(2**i) for i in range(10, 34, 2))


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "pdserve:"
        self.time_to_first_token = Histogram(p + "time_to_first_token_seconds", "Time to first token.",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(p + "inter_token_latency_seconds", "Time between output tokens.",
                                             buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency.",
                                             buckets=REQUEST_BUCKETS, registry=r)
        self.request_queue_time = Histogram(p + "request_queue_time_seconds", "Time waiting for admission.",
                                            buckets=REQUEST_BUCKETS, registry=r)
        self.request_prefill_time = Histogram(p + "request_prefill_time_seconds", "Prefill on the worker.",
                                              buckets=REQUEST_BUCKETS, registry=r)
        self.request_decode_time = Histogram(p + "request_decode_time_seconds", "Decode phase.",
                                             buckets=REQUEST_BUCKETS, registry=r)
        self.kv_transfer_seconds = Histogram(p + "kv_transfer_seconds", "KV fetch time on the decode worker.",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.kv_transfer_bytes = Histogram(p + "kv_transfer_bytes", "KV bytes per transfer.",
                                           buckets=BYTES_BUCKETS, registry=r)
        self.kv_transfer_failures = Counter(p + "kv_transfer_failures", "KV transfers that failed.", registry=r)
        self.request_timeouts = Counter(p + "request_timeouts", "Requests ended by --request-timeout (504).",
                                        registry=r)
        self.requests_refused = Counter(p + "requests_refused", "Requests refused at admission (429/503).",
                                        ["reason"], registry=r)
        self.local_prefills = Counter(p + "local_prefills", "Short prompts prefilled by their decode worker.",
                                      registry=r)
        self.prefill_failovers = Counter(p + "prefill_failovers", "Prefills retried after their worker died.",
                                         registry=r)
        self.kv_recomputes = Counter(p + "kv_recomputes", "Prompts recomputed on the decode side: KV lost or corrupt.",
                                     registry=r)
        self.decode_failovers = Counter(p + "decode_failovers", "Streams resumed on another decode worker.",
                                        registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(p + "request_success", "Finished requests.", ["finished_reason"],
                                       registry=r)
        self.prefix_cache_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up.", ["worker"],
                                            registry=r)
        self.prefix_cache_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found cached.", ["worker"],
                                         registry=r)
        self.num_requests_running = Gauge(p + "num_requests_running", "Requests in the batch.", ["worker"],
                                          registry=r)
        self.num_requests_waiting = Gauge(p + "num_requests_waiting", "Requests queued.", ["worker"], registry=r)
        self.kv_cache_usage_perc = Gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use.", ["worker"],
                                         registry=r)
        self.workers_alive = Gauge(p + "workers_alive", "Workers answering pings.", ["role"], registry=r)
        self.prefill_wait_seconds = Gauge(p + "prefill_wait_seconds", "The router's estimate of a new prompt's "
                                          "wait for its first token at the prefill pool (queued tokens at the "
                                          "measured rate, plus the hop); set once measured.", registry=r)
        # Per-phase efficiency: achieved rates over the steps of each phase since the last report
        # (busy time, not wall time), and their ratio to the worker's own measured ceiling.
        self.prefill_flops_per_second = Gauge(p + "prefill_flops_per_second", "Prefill steps' FLOP/s.",
                                              ["worker"], registry=r)
        self.prefill_flops_utilization = Gauge(p + "prefill_flops_utilization",
                                               "Prefill FLOP/s over the worker's matmul peak (MFU).", ["worker"],
                                               registry=r)
        self.decode_bytes_per_second = Gauge(p + "decode_bytes_per_second", "Decode steps' bytes read per second.",
                                             ["worker"], registry=r)
        self.decode_bandwidth_utilization = Gauge(p + "decode_bandwidth_utilization",
                                                  "Decode bytes/s over the worker's memory bandwidth (MBU).",
                                                  ["worker"], registry=r)
        self.peak_flops_per_second = Gauge(p + "peak_flops_per_second", "The worker's measured matmul peak.",
                                           ["worker"], registry=r)
        self.peak_bytes_per_second = Gauge(p + "peak_bytes_per_second", "The worker's measured memory bandwidth.",
                                           ["worker"], registry=r)
        self._seen: dict[tuple[str, str], float] = {}
        self._phase_seen: dict[tuple[str, str], tuple[int, float]] = {}

    def record_worker(self, stats) -> None:
        """Copy one `services.protocol.WorkerStats` report into the gauges and counters."""
        w = stats.worker_id
        self.num_requests_running.labels(w).set(stats.num_running)
        self.num_requests_waiting.labels(w).set(stats.num_waiting)
        self.kv_cache_usage_perc.labels(w).set(1 - stats.num_free_kv_blocks / max(1, stats.num_kv_blocks))
        for counter, name, total in ((self.prefix_cache_queries.labels(w), "q", stats.num_prefix_queries),
                                     (self.prefix_cache_hits.labels(w), "h", stats.num_prefix_hits),
                                     (self.kv_transfer_failures, "f", stats.kv_transfer_failures)):
            delta = total - self._seen.get((w, name), 0)
            if delta > 0:  # the worker's totals are cumulative; Prometheus counters only go up
                counter.inc(delta)
            self._seen[(w, name)] = total
        self._record_efficiency(stats)
        for seconds in stats.queue_times:
            self.request_queue_time.observe(seconds)
        for seconds, num_bytes in stats.kv_transfers:
            self.kv_transfer_seconds.observe(seconds)
            self.kv_transfer_bytes.observe(num_bytes)

    def _record_efficiency(self, stats) -> None:
        w = stats.worker_id
        self.peak_flops_per_second.labels(w).set(stats.peak_flops)
        self.peak_bytes_per_second.labels(w).set(stats.peak_bytes_per_second)
        for phase, work, seconds, rate, utilization, peak in (
                ("prefill", stats.prefill_flops, stats.prefill_seconds, self.prefill_flops_per_second,
                 self.prefill_flops_utilization, stats.peak_flops),
                ("decode", stats.decode_bytes, stats.decode_seconds, self.decode_bytes_per_second,
                 self.decode_bandwidth_utilization, stats.peak_bytes_per_second)):
            key = (w, phase)
            last_work, last_seconds = self._phase_seen.get(key, (0, 0.0))
            if seconds > last_seconds:  # the phase ran since the last report; else keep the last value
                achieved = (work - last_work) / (seconds - last_seconds)
                rate.labels(w).set(achieved)
                utilization.labels(w).set(achieved / peak if peak > 0 else 0.0)
            self._phase_seen[key] = (work, seconds)


METRICS = Metrics()
