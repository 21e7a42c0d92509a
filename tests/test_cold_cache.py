"""The kernel plan times few-row products with their weight out of the CPU's caches, as the engine runs them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from services.int4_weight import Int4Weight
from services.kernels import cold_cache
from services.kernels.cold_cache import ColdCache, last_level_cache_bytes, weight_tensors
from services.kernels.kernel_plan import _fastest
from services.kernels.weight_layouts import (
    PREFER_MARGIN,
    PREFILL_PREFER_MARGIN,
    Preference,
    preference,
    reads_panels,
)
from services.quantized_weight import Int8Weight


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
    fits = [torch.ones(1 << 18)]  # 1 MB: a model that fits is read from the cache
    assert ColdCache.for_weights(fits, torch.device("cpu")) is None
    tied = torch.ones(3 << 16)  # 768 KB listed twice (an embedding tied to lm_head): read once, so it fits
    assert ColdCache.for_weights([tied, tied], torch.device("cpu")) is None
    outgrows = [torch.ones(1 << 18), Int8Weight.quantize(torch.ones(64, 64))]
    assert ColdCache.for_weights(outgrows, torch.device("meta")) is None  # off the CPU: nothing to evict
    cold = ColdCache.for_weights(outgrows, torch.device("cpu"))
    assert cold is not None and cold.budget == cold_cache.SWEEP_CACHES << 20
    cold.evict(outgrows[1])


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


def test_fastest_prefers_what_it_is_told_to_within_the_margin(monkeypatch):
    # int4's decode buckets prefer the panels (a weight read only through them drops its row layout): a clock that
    # charges each candidate its cost; the preferred one wins within PREFER_MARGIN (3%) of the fastest, not beyond
    cost, now = {"row": 100, "panels": 102}, [0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def run(name: str) -> None:
        now[0] += cost[name]

    fns = {name: lambda name=name: run(name) for name in cost}
    panels = Preference(lambda name: name == "panels", PREFER_MARGIN)
    assert _fastest(fns, torch.device("cpu"), rows=1) == "row"
    assert _fastest(fns, torch.device("cpu"), rows=1, prefer=panels) == "panels"
    cost["panels"] = 104
    assert _fastest(fns, torch.device("cpu"), rows=1, prefer=panels) == "row"
    assert _fastest(fns, torch.device("cpu"), rows=128, prefer=panels._replace(margin=PREFILL_PREFER_MARGIN)) == "panels"
    cost["panels"] = 111
    assert _fastest(fns, torch.device("cpu"), rows=128, prefer=panels._replace(margin=PREFILL_PREFER_MARGIN)) == "row"


def test_bf16_weights_prefer_their_panels_in_every_bucket_and_prefill_by_more():
    assert preference((16, 64, "bfloat16"), 1) == Preference(reads_panels, PREFER_MARGIN)
    assert preference((16, 64, "bfloat16"), 128) == Preference(reads_panels, PREFILL_PREFER_MARGIN)
    assert preference((16, 64, "int4"), 32) == Preference(reads_panels, PREFER_MARGIN)
    assert preference((16, 64, "int4"), 128) is None  # its prefill reads them through from_panels_alone
    assert preference((16, 64, "int8"), 8) == Preference(reads_panels, PREFER_MARGIN)  # int8's too (weight-only)
    assert preference((16, 64, "int8"), 128) is None and preference((16, 64, "w8a8"), 1) is None
    assert preference((16, 64, "float32"), 1) is None


def test_the_hot_set_is_read_around_each_timed_call(monkeypatch):
    monkeypatch.setattr(cold_cache, "last_level_cache_bytes", lambda: 1 << 20)
    cold = ColdCache.for_weights([torch.ones(1 << 19)], torch.device("cpu"))
    assert cold.hot.numel() * 4 == cold_cache.HOT_BYTES
    reads = []
    monkeypatch.setattr(cold, "hot", type("Hot", (), {"sum": lambda self: reads.append("hot")})())
    monkeypatch.setattr(cold_cache, "read", lambda tensor: reads.append("other weights"))
    cold.evict(torch.ones(4))
    cold.reread()
    assert reads == ["other weights", "hot", "hot"]


def test_eviction_reads_the_other_weights_then_flushes_its_own(monkeypatch):
    # the sweep: the other weights from where the last one stopped, up to the budget, never the weight timed
    flushed, read = [], []
    monkeypatch.setattr(cold_cache, "read", lambda tensor: read.append(tensor.data_ptr()))
    weights = [torch.ones(256 * k) for k in (1, 2, 3, 4)]  # 1, 2, 3 and 4 KB
    quantized = Int8Weight.quantize(torch.randn(8, 64))
    cold = ColdCache(1024, weights + [quantized], flush=flushed.append)
    cold.budget = 5 << 10
    at = [w.data_ptr() for w in weights]
    cold.evict(quantized)
    assert read == at[:3] and [t.data_ptr() for t in flushed] == [quantized.qweight.data_ptr(),
                                                                 quantized.scale.data_ptr()]
    read.clear()
    cold.evict(weights[0])  # 4 KB, the quantized weight's 512 + 32 bytes, then around past its own to the 2 KB
    assert read == [at[3], quantized.qweight.data_ptr(), quantized.scale.data_ptr(), at[1]]
    int4 = Int4Weight.quantize(torch.randn(8, 64))
    assert {t.data_ptr() for t in weight_tensors(int4)} == {int4.packed.data_ptr(), int4.scale.data_ptr(),
                                                            int4.low.data_ptr()}
    dense = torch.randn(3, 5)
    assert weight_tensors(dense) == [dense]


def test_read_takes_any_weights_bytes():
    for tensor in (torch.ones(7, dtype=torch.int8), torch.ones(5, 3, dtype=torch.bfloat16), torch.ones(1)[:0],
                   torch.ones(9, dtype=torch.uint8)[1:]):
        cold_cache.read(tensor)  # odd sizes, an empty tensor, bytes that start off a 4-byte boundary


def test_native_flush_leaves_the_values(native):
    if not hasattr(native, "flush_cache_lines"):
        pytest.skip("flush_cache_lines is built on x86 CPUs only")
    t = torch.randn(77001)[3:]  # its bytes start mid-line
    before = t.clone()
    native.flush_cache_lines(t)
    native.flush_cache_lines(torch.empty(0))
    assert torch.equal(t, before)
    with pytest.raises(RuntimeError, match="a contiguous CPU tensor expected"):
        native.flush_cache_lines(torch.randn(4, 6)[:, 1:])
