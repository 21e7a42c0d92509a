"""The prefill attention's products on a CPU with AMX: the tile unit's (prefill_tiles.h, the default there) and the bf16
pairs' (pair_gemm.h), each against the gather + SDPA reference and each other: 1 to 20 query heads a kv head (row tiles
cut short: 64 / G positions of G rows), head dims of 1 to 8 steps of 32 (others: the pairs path), whole prompts and
chunks after a cached prefix, key blocks cut by the causal diagonal."""

from __future__ import annotations

import pytest
import torch
from test_native_kernels import TOLERANCE, prefill_case, prefill_reference


@pytest.fixture
def tiles(native):
    if not hasattr(native, "set_prefill_attention_tiles"):
        pytest.skip("built only on CPUs with AMX-BF16")
    yield native
    native.set_prefill_attention_tiles(True)


def attend(native, q, cache, table, context_len, on: bool, block_size: int = 16) -> torch.Tensor:
    native.set_prefill_attention_tiles(on)
    return native.prefill_attention(q, cache, table, context_len, block_size, 0.3)


# (new tokens, context, heads, kv heads, head dim): G 1, 3, 4, 5, 8, 16, 20; Dh 32 .. 256 and 80 (not a whole step)
SHAPES = [(37, 37, 6, 2, 64), (70, 201, 12, 3, 64), (150, 150, 32, 8, 64), (64, 64, 4, 4, 32), (96, 300, 4, 1, 32),
          (33, 100, 10, 2, 96), (129, 129, 16, 1, 128), (20, 85, 20, 1, 64), (17, 17, 8, 1, 256), (50, 90, 8, 2, 80),
          (1, 1, 4, 4, 32), (5, 77, 16, 2, 128)]


@pytest.mark.parametrize("new_tokens,context_len,heads,kv_heads,head_dim", SHAPES)
def test_both_paths_match_the_reference_and_each_other(tiles, new_tokens, context_len, heads, kv_heads, head_dim):
    q, cache, table = prefill_case(torch.bfloat16, new_tokens, context_len, heads, kv_heads, head_dim)
    want = prefill_reference(q, cache, table, context_len, 16, 0.3)
    on, off = attend(tiles, q, cache, table, context_len, True), attend(tiles, q, cache, table, context_len, False)
    torch.testing.assert_close(on.float(), want, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(off.float(), want, **TOLERANCE[torch.bfloat16])
    # the same bf16 products, summed in another order: a bf16 rounding step apart at most
    torch.testing.assert_close(on.float(), off.float(), rtol=1e-2, atol=2e-2)


def test_the_tiles_read_only_the_context_and_a_strided_q(tiles):
    # every slot past the context poisoned with NaN: the tiles read whole key blocks, zeros past the context
    q, cache, table = prefill_case(torch.bfloat16, 45, 70, 8, 2, 64, block_size=8)
    before = attend(tiles, q, cache, table, 70, True, block_size=8)
    used = {int(table[t // 8]) * 8 + t % 8 for t in range(70)}
    poisoned = cache.clone()
    for slot in set(range(cache.shape[1])) - used:
        poisoned[:, slot] = float("nan")
    assert torch.equal(attend(tiles, q, poisoned, table, 70, True, block_size=8), before)
    qkv = torch.cat([q, torch.full((45, 4, 64), float("nan"), dtype=torch.bfloat16)], dim=1)
    assert torch.equal(attend(tiles, qkv[:, :8], cache, table, 70, True, block_size=8), before)


def test_the_switch_says_what_it_was(tiles):
    assert tiles.set_prefill_attention_tiles(False) is True
    assert tiles.set_prefill_attention_tiles(True) is False
