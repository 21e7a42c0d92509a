"""The in-place paged decode kernels for CUDA: which ones load, that FlexAttention's paged pattern
computes the reference's values (eagerly, on CPU), and that the choice falls back to torch."""

from __future__ import annotations

import types

import pytest
import torch

from services import gpu_decode_attention as gpu
from services.attention import AttentionMetadata, torch_decode_attention


def missing(name: str):
    raise ImportError(f"No module named {name!r}")


def only(**modules):
    def import_module(name: str):
        if name not in modules:
            missing(name)
        return types.SimpleNamespace(flash_attn_with_kvcache=modules[name])
    return import_module


def test_no_flash_attention_installed_means_no_flash_candidate():
    assert gpu.flash_kernel(16, missing) is None
    assert list(gpu.candidates(16, torch.device("cuda"), missing)) == ["flex", "torch"]
    assert list(gpu.candidates(16, torch.device("cpu"), missing)) == ["flex", "torch"]  # flash is CUDA only
    assert list(gpu.candidates(16, torch.device("cuda"), missing, mode="native")) == ["torch"]  # nothing compiled


def test_native_mode_takes_flash_where_installed_and_nothing_else():
    fa3 = only(flash_attn_interface=lambda q, *a, **k: q)
    assert list(gpu.candidates(16, torch.device("cuda"), fa3, mode="native")) == ["flash"]
    assert list(gpu.candidates(16, torch.device("cuda"), fa3)) == ["flash", "flex", "torch"]


def test_fa2_pages_need_a_block_size_multiple_of_256_fa3_any():
    calls = []

    def fa(q, k_cache, v_cache, **kwargs):
        calls.append((k_cache.shape, sorted(kwargs)))
        return q
    assert gpu.flash_kernel(16, only(flash_attn=fa)) is None
    fa2 = gpu.flash_kernel(256, only(flash_attn=fa))
    fa3 = gpu.flash_kernel(16, only(flash_attn_interface=fa, flash_attn=fa))
    kv = torch.zeros(2, 4 * 16, 2, 8)
    meta = AttentionMetadata(torch.empty(0), [1], [3], torch.tensor([[2]]), 16, None, torch.tensor([3]))
    fa3(torch.zeros(1, 4, 8), kv, meta, 0.5)
    assert calls == [((4, 16, 2, 8), ["cache_seqlens", "causal", "page_table", "softmax_scale"])]
    assert fa2 is not None


def scattered_batch(block_size: int = 4, head_dim: int = 8):
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 24 * block_size, 2, head_dim, generator=gen)  # [2, S, K, Dh], 24 blocks
    q = torch.randn(3, 4, head_dim, generator=gen)  # [B, H, Dh]
    tables = torch.tensor([[5, 7, 0, 0], [1, 0, 0, 0], [23, 2, 9, 11]])  # padded with block 0
    lens = torch.tensor([6, 3, 15])
    mask = (torch.arange(15)[None, :] < lens[:, None])[:, None, None, :]
    return q, kv, AttentionMetadata(torch.empty(0, dtype=torch.int64), [1] * 3, lens.tolist(), tables,
                                    block_size, mask, lens)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_paged_decode_equals_the_reference():
    q, kv, meta = scattered_batch()
    expected = torch_decode_attention(q, kv, meta, 0.35)
    got = gpu.flex_kernel(compile_=False)(q, kv, meta, 0.35)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    kv[:, 0] += 100.0  # slot 0 (block 0 pads the tables) is no sequence's: nothing changes
    torch.testing.assert_close(gpu.flex_kernel(compile_=False)(q, kv, meta, 0.35), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_choice_drops_kernels_that_fail_or_differ():
    def broken(q, kv, meta, scale):
        raise RuntimeError("no kernel image for this architecture")

    def wrong(q, kv, meta, scale):
        return torch_decode_attention(q, kv, meta, scale) + 1.0
    name, kernel = gpu.choose((4, 2, 8), torch.float32, torch.device("cpu"), 4,
                              {"flash": broken, "flex": wrong, "torch": torch_decode_attention})
    assert (name, kernel) == ("torch", torch_decode_attention)
    name, _ = gpu.choose((4, 2, 8), torch.float32, torch.device("cpu"), 4, {"flash": broken})
    assert name == "torch"  # nothing qualified: the reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (benchmarks/gpu_check.sh)")
def test_cuda_choice_is_a_candidate_that_matches_the_reference():
    device = torch.device("cuda")
    found = gpu.candidates(16, device)
    name, kernel = gpu.choose((32, 8, 64), torch.bfloat16, device, 16, found)
    assert name in found
    q, kv, meta = scattered_batch(16, head_dim=64)  # compiled FlexAttention refuses head dims under 16
    q, kv = q.to(device, torch.bfloat16), kv.to(device, torch.bfloat16)
    meta = AttentionMetadata(meta.slot_mapping.to(device), meta.query_lens, meta.context_lens,
                             meta.block_tables.to(device), 16, meta.decode_mask.to(device),
                             meta.context_lens_tensor.to(device))
    expected = torch_decode_attention(q, kv, meta, 0.35).float()
    for kernel in found.values():  # every candidate that loads, not only the fastest
        torch.testing.assert_close(kernel(q, kv, meta, 0.35).float(), expected, atol=2e-2, rtol=2e-2)
