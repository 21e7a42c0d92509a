"""Kernel choice by measurement: every candidate computes the same product, choices are cached per
host, and a busy host's timings are not kept."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from services.kernels import cold_cache, kernel_plan
from services.kernels.kernel_plan import BUCKETS, KernelPlan, bucket_of
from services.kernels.linear_candidates import candidates
from services.kernels.native import build_key, cpu_model, load
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.kernels.stream_variants import SKINNY_VARIANTS
from services.quantized_weight import Int8Weight


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path)
    return tmp_path


def test_buckets():
    assert [bucket_of(n) for n in (1, 2, 8, 9, 64, 65, 4096)] == [0, 1, 1, 2, 2, 3, 3]
    assert BUCKETS == ("1", "2-8", "9-64", "65+")


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 40, 70])
def test_every_candidate_computes_the_same_product(quantized, rows):
    g = torch.Generator().manual_seed(rows)
    dense = torch.randn(24, 40, generator=g).bfloat16()
    weight = Int8Weight.quantize(dense) if quantized else dense
    reference = weight.dequantize(torch.float32) if quantized else dense.float()
    x = torch.randn(rows, 40, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    found = candidates("int8" if quantized else "bfloat16", True, 40, {1: 1, 5: 8, 40: 64, 70: 1 << 62}[rows], load(),
                       packed=True)
    assert all((name in found) == (load() is not None and rows <= 64) for name in SKINNY_VARIANTS)
    assert ("torch.mv" in found) == (not quantized and rows == 1)
    assert ("onednn.packed" in found) == (not quantized and ONEDNN_PACKS.supported(torch.bfloat16))
    assert "torch.int8pack" not in found  # 40 columns: torch's kernel would crash
    onednn = rows > 1 and ONEDNN_PACKS.supported(torch.float32)
    assert ("float32.onednn" in found) == (not quantized and onednn)
    assert ("dequant.float32.onednn" in found) == (quantized and onednn)
    assert ("native.tiled" in found) == (rows > 1 and hasattr(load(), "tiled_linear"))
    if quantized:
        assert "torch.int8pack" in candidates("int8", True, 64, 8, None)
    for name, fn in found.items():
        got = fn(x, weight, bias)
        assert got.shape == (rows, 24) and got.dtype == torch.bfloat16, name
        want = F.linear(x.float(), reference, bias.float())
        assert (got.float() - want).abs().max() <= 0.02 * want.abs().max(), name  # bf16 rounding (and scale's)


@pytest.mark.parametrize("rows", [5, 70])
def test_float32_weights_have_onednns_product_beside_torchs(rows):
    g = torch.Generator().manual_seed(rows)
    weight, x, bias = torch.randn(24, 40, generator=g), torch.randn(rows, 40, generator=g), torch.randn(24, generator=g)
    found = candidates("float32", True, 40, 8 if rows <= 8 else 1 << 62, None)
    if not ONEDNN_PACKS.supported(torch.float32):
        pytest.skip("this torch build has no oneDNN float32 product")
    want = F.linear(x.double(), weight.double(), bias.double())
    for name in ("torch.linear", "onednn.linear"):
        got = found[name](x, weight, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, 24)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(32, 16, generator=g), torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g)]


def test_modes_and_the_cache(cache_dir, monkeypatch):
    # never busy: every measurement is kept (whether a host counts as busy depends on the thread count an
    # earlier test left torch with)
    monkeypatch.setattr(kernel_plan.time, "process_time", iter(range(0, 10**6, 1000)).__next__)
    torch_only = KernelPlan.choose(weights(), (4, 2, 8), torch.float32, torch.device("cpu"), "torch")
    assert torch_only.native is None and torch_only.attention_choice == "torch" == torch_only.prefill_choice
    assert torch_only.prefill_attention is None  # paged_attention's SDPA path
    assert set(torch_only.linear_choices) == {(32, 16, "float32"), (16, 32, "float32")}  # distinct shapes once
    for names in torch_only.linear_choices.values():  # oneDNN's products (packed copy, plain) are torch's own too
        assert names[0] in ("torch.linear", "torch.mv", "onednn.packed")
        assert all(n in ("torch.linear", "onednn.packed", "onednn.linear") for n in names[1:])
    if load() is None:
        pytest.skip("no native kernels on this host")
    forced = KernelPlan.choose(weights(), (4, 2, 8), torch.float32, torch.device("cpu"), "native")
    assert forced.attention_choice == "native" == forced.prefill_choice
    assert forced.prefill_attention is load().prefill_attention and "prefill attention native" in forced.summary
    assert all(names == ("native", "native", "native", "torch.linear") for names in forced.linear_choices.values())
    assert "measured" not in forced.summary  # fixed choices: engines compared token by token compute alike
    measured = KernelPlan.choose(weights(), (4, 2, 8), torch.float32, torch.device("cpu"), "auto")
    assert "measured" in measured.summary and "from the cache" not in measured.summary
    saved = json.loads((cache_dir / "kernels" / "choices.json").read_text())
    # one entry per host key: torch-only choices (torch.mv or torch.linear for one row) and the auto ones
    assert sorted(key.split(" | ")[2] for key in saved) == sorted(["native off", f"native {build_key()}"])
    assert all(key.startswith(cpu_model() + " | ") for key in saved)  # the CPU model opens the key
    again = KernelPlan.choose(weights(), (4, 2, 8), torch.float32, torch.device("cpu"), "auto")
    assert "from the cache" in again.summary
    assert again.linear_choices == measured.linear_choices and again.attention_choice == measured.attention_choice
    assert again.prefill_choice == measured.prefill_choice
    host_entries = saved[next(key for key in saved if "native off" not in key)]
    assert host_entries["prefill attention H4 K2 Dh8 torch.float32"] == measured.prefill_choice


def test_few_rows_are_timed_with_their_weight_out_of_the_caches(cache_dir, monkeypatch):
    # weights larger than the last-level cache: before each timed call of 1 to 64 rows the weight timed is evicted
    # (the others swept, its own lines flushed where the native build has flush_cache_lines); 65+ rows are timed warm
    monkeypatch.setattr(kernel_plan.time, "process_time", iter(range(0, 10**6, 1000)).__next__)
    monkeypatch.setattr(cold_cache, "last_level_cache_bytes", lambda: 1024)
    evicted = []
    evict = cold_cache.ColdCache.evict
    monkeypatch.setattr(cold_cache.ColdCache, "evict",
                        lambda self, weight: evicted.append((weight, self.flush)) or evict(self, weight))
    given = weights()
    plan = KernelPlan.choose(given, (4, 2, 8), torch.float32, torch.device("cpu"), "auto")
    assert "measured" in plan.summary
    assert {id(w) for w, _ in evicted} == {id(given[0]), id(given[1])}  # the first weight of each shape
    flush = getattr(load(), "flush_cache_lines", None)
    assert all(f is flush for _, f in evicted)


def test_a_busy_hosts_timings_are_used_but_not_kept(cache_dir, monkeypatch):
    if load() is None:
        pytest.skip("no native kernels on this host")
    monkeypatch.setattr(kernel_plan.time, "process_time", lambda: 0.0)  # as if other processes had our cores
    plan = KernelPlan.choose(weights(), (4, 2, 8), torch.float32, torch.device("cpu"), "auto")
    assert "host busy: not cached" in plan.summary
    assert not (cache_dir / "kernels" / "choices.json").exists()


def test_a_stale_cached_name_is_measured_again(cache_dir, monkeypatch):
    monkeypatch.setattr(kernel_plan.time, "process_time", iter(range(0, 10**6, 1000)).__next__)
    KernelPlan.choose(weights(), (4, 2, 8), torch.float32, torch.device("cpu"), "torch")
    path = cache_dir / "kernels" / "choices.json"
    saved = json.loads(path.read_text())
    for entries in saved.values():
        for entry in entries:
            entries[entry] = "no-such-kernel"
    path.write_text(json.dumps(saved))
    plan = KernelPlan.choose(weights(), (4, 2, 8), torch.float32, torch.device("cpu"), "torch")
    assert "measured" in plan.summary
    assert all(n in ("torch.linear", "torch.mv", "onednn.packed", "onednn.linear")
               for names in plan.linear_choices.values() for n in names)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="kernels must be one of auto, torch, native, got 'fast'"):
        KernelPlan.choose(weights(), (4, 2, 8), torch.float32, torch.device("cpu"), "fast")


def test_packed_copies_are_kept_only_where_chosen_and_only_when_they_fit(cache_dir, monkeypatch):
    if not ONEDNN_PACKS.supported(torch.float32):
        pytest.skip("this torch build packs no float32 weights for oneDNN")
    mats = weights()
    # as timing does, runs every candidate (so packs all)
    def packed_wins_many_rows_of_32x16(fns, device, rows, before=None, after=None, prefer=None):
        for fn in fns.values():
            fn()
        shape = next(iter(fns.values())).args[1].shape
        wins = "onednn.packed" in fns and rows > 8 and shape == (32, 16)
        return "onednn.packed" if wins else next(n for n in fns if n != "onednn.packed")
    monkeypatch.setattr(kernel_plan, "_fastest", packed_wins_many_rows_of_32x16)
    plan = KernelPlan.choose(mats, (4, 2, 8), torch.float32, torch.device("cpu"), "auto")
    assert plan.linear_choices[(32, 16, "float32")][2:] == ("onednn.packed",) * 2
    assert "onednn.packed" not in plan.linear_choices[(16, 32, "float32")]
    # both 32 x 16 weights hold a packed copy (the second was never timed); the 16 x 32 one's, made by its
    # timing, was dropped
    assert [ONEDNN_PACKS.holds(w) for w in mats] == [True, False, True]
    assert plan.packed_bytes == 2 * 32 * 16 * 4 and "copies in kernels' layouts" in plan.summary
    x = torch.randn(70, 16)
    assert torch.allclose(plan.linear(x, mats[2]), F.linear(x, mats[2]), rtol=1e-5, atol=1e-5)  # the packed one
    # where two copies would not fit, packing is not even timed
    monkeypatch.setattr(kernel_plan, "fits", lambda extra_bytes: False)
    others = weights()
    tight = KernelPlan.choose(others, (4, 2, 8), torch.float32, torch.device("cpu"), "auto")
    assert all("onednn.packed" not in names for names in tight.linear_choices.values())
    assert tight.packed_bytes == 0 and not any(ONEDNN_PACKS.holds(w) for w in others)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_copy_serves_every_row_count(dtype):
    if not ONEDNN_PACKS.supported(dtype):
        pytest.skip(f"this torch build packs no {dtype} weights for oneDNN")
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(37, 50, generator=g).to(dtype), torch.randn(37, generator=g).to(dtype)
    for rows in (1, 5, 33, 130):
        x = torch.randn(rows, 50, generator=g).to(dtype)
        got = ONEDNN_PACKS.linear(x, weight, bias)
        want = F.linear(x.float(), weight.float(), bias.float())
        assert got.shape == (rows, 37) and got.dtype == dtype
        assert (got.float() - want).abs().max() <= (1e-4 if dtype == torch.float32 else 0.02) * want.abs().max()
    strided = torch.randn(50, 9, generator=g).to(dtype).t()  # a transposed view is multiplied as it reads
    assert torch.allclose(ONEDNN_PACKS.linear(strided, weight, None).float(), F.linear(strided, weight).float(),
                          rtol=0.02, atol=0.02)
    ONEDNN_PACKS.drop(weight)
    assert not ONEDNN_PACKS.holds(weight)
