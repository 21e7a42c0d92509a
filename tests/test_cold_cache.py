"""The kernel plan times few-row products with their weight out of the CPU's caches, as the engine runs them."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from services.kernels import cold_cache
from services.kernels.cold_cache import ColdCache, last_level_cache_bytes
from services.kernels.kernel_plan import _fastest


def write_cache(folder: Path, index: int, kind: str, size: str) -> None:
    (folder / f"index{index}").mkdir(parents=True)
    (folder / f"index{index}" / "type").write_text(kind + "\n")
    (folder / f"index{index}" / "size").write_text(size + "\n")


def test_the_last_level_cache_is_the_largest_data_cache_sysfs_names(tmp_path):
    write_cache(tmp_path, 0, "Data", "32K")
    write_cache(tmp_path, 1, "Instruction", "4096M")  # instruction caches do not count
    write_cache(tmp_path, 2, "Unified", "1024K")
    write_cache(tmp_path, 3, "Unified", "32768K")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "absent") == cold_cache.DEFAULT_LLC_BYTES
    write_cache(tmp_path / "odd", 0, "Unified", "lots")  # unreadable sizes are skipped
    assert last_level_cache_bytes(tmp_path / "odd") == cold_cache.DEFAULT_LLC_BYTES


def test_a_cold_cache_only_where_the_weights_outgrow_it(monkeypatch):
    monkeypatch.setattr(cold_cache, "last_level_cache_bytes", lambda: 1 << 20)
    assert ColdCache.for_weights(1 << 20, torch.device("cpu")) is None  # a model that fits is read from the cache
    assert ColdCache.for_weights(8 << 20, torch.device("meta")) is None  # off the CPU: nothing to evict
    cold = ColdCache.for_weights((1 << 20) + 1, torch.device("cpu"))
    assert cold is not None and cold.buffer.numel() * 4 == 2 << 20  # twice the cache
    cold.evict()


def test_fastest_runs_the_eviction_before_every_timed_call():
    calls: list[str] = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    _fastest(fns, torch.device("cpu"), rows=1, before=lambda: calls.append("evict"))
    timed = calls[2:]  # after one untimed warm-up call each
    assert calls[:2] == ["a", "b"] and len(timed) > 0
    assert timed[0::2] == ["evict"] * (len(timed) // 2) and "evict" not in timed[1::2]


def test_fastest_times_the_reread_with_each_call(monkeypatch):
    # before (evict, untimed), the call, after (reread) — the clock read around the call and the reread only
    calls: list[str] = []
    ticks = iter(range(10**6))
    monkeypatch.setattr(time, "perf_counter", lambda: calls.append("clock") or next(ticks))
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    _fastest(fns, torch.device("cpu"), rows=1, before=lambda: calls.append("evict"), after=lambda: calls.append("reread"))
    timed = calls[2:]
    assert timed[:10] == ["evict", "clock", "a", "reread", "clock", "evict", "clock", "b", "reread", "clock"]
    assert len(timed) == 10 * 7  # 7 rounds, two candidates, five entries each


def test_the_hot_set_is_read_around_each_timed_call(monkeypatch):
    monkeypatch.setattr(cold_cache, "last_level_cache_bytes", lambda: 1 << 20)
    cold = ColdCache.for_weights(8 << 20, torch.device("cpu"))
    assert cold.hot.numel() * 4 == cold_cache.HOT_BYTES
    reads = []
    monkeypatch.setattr(cold, "hot", type("Hot", (), {"sum": lambda self: reads.append("hot")})())
    monkeypatch.setattr(cold, "buffer", type("Big", (), {"sum": lambda self: reads.append("big")})())
    cold.evict()
    cold.reread()
    assert reads == ["big", "hot", "hot"]
