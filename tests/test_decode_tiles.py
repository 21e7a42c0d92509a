"""The decode attention's two bf16 paths on a CPU with AMX: the tile unit's (decode_tiles.h, the default there) and the
bf16 pairs' (decode_pairs.h, every AVX512-BF16 CPU's), each against the gather + SDPA reference and each other, on
head dims of 1 to 8 steps of 32 dims, 1 to 16 query heads a kv head (more: the pairs path), runs cut short by the
context and by blocks of 8 tokens."""

from __future__ import annotations

import pytest
import torch
from test_native_kernels import TOLERANCE, decode_case

from services.attention import torch_decode_attention


@pytest.fixture
def tiles(native):
    if not hasattr(native, "set_decode_attention_tiles"):
        pytest.skip("built only on CPUs with AMX-BF16")
    yield native
    native.set_decode_attention_tiles(True)


def attend(native, q, cache, meta, on: bool) -> torch.Tensor:
    native.set_decode_attention_tiles(on)
    return native.paged_decode_attention(q, cache, meta.block_tables, meta.context_lens_tensor, meta.block_size, 0.3)


# (heads, kv heads, head dim, block size): G 1, 2, 4, 5, 8, 16 and 17 (past a tile: the pairs path); Dh 32 to 256
# (the sums kept in tiles up to 64, through memory past it); blocks of 8, 16 and 32 tokens
SHAPES = [(8, 8, 32, 16), (8, 4, 64, 8), (32, 8, 64, 16), (10, 2, 96, 16), (16, 2, 128, 32), (16, 1, 256, 16),
          (16, 1, 64, 16), (34, 2, 64, 16), (5, 1, 160, 8)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_both_paths_match_the_reference_and_each_other(tiles, heads, kv_heads, head_dim, block_size):
    q, cache, meta = decode_case(torch.bfloat16, num_seqs=4, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                 block_size=block_size, context_lens=(1, 15, 17, 70))
    want = torch_decode_attention(q.float(), cache.float(), meta, 0.3)
    on, off = attend(tiles, q, cache, meta, True), attend(tiles, q, cache, meta, False)
    torch.testing.assert_close(on.float(), want, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(off.float(), want, **TOLERANCE[torch.bfloat16])
    # the same probabilities (rounded to bf16 alike) weigh the same values; only the sums' order differs
    torch.testing.assert_close(on.float(), off.float(), rtol=8e-3, atol=1e-2)


def test_the_tile_path_does_not_depend_on_the_batch_or_the_threads(tiles):
    q, cache, meta = decode_case(torch.bfloat16, num_seqs=5, heads=32, kv_heads=8, head_dim=64, block_size=16,
                                 context_lens=(70, 1, 33, 130, 16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = attend(tiles, q, cache, meta, True)
        for n in (1, 3):
            torch.set_num_threads(n)
            for i in range(5):
                alone = tiles.paged_decode_attention(q[i : i + 1], cache, meta.block_tables[i : i + 1],
                                                     meta.context_lens_tensor[i : i + 1], 16, 0.3)
                assert torch.equal(alone[0], batch[i]), (n, i)
    finally:
        torch.set_num_threads(threads)


def test_the_switch_says_what_it_was(tiles):
    assert tiles.set_decode_attention_tiles(False) is True
    assert tiles.set_decode_attention_tiles(True) is False
