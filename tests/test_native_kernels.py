"""The native CPU kernels against torch's reference, on odd shapes, in every weight format."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.attention import AttentionMetadata, torch_decode_attention
from services.kernels import native as native_build
from services.kernels.stream_variants import SKINNY_VARIANTS
from services.quantized_weight import Int8Weight

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
             torch.float16: dict(rtol=2e-3, atol=5e-3)}


# every variant the kernel plan offers (rows in flight, non-temporal prefetch, rows one from each quarter)
VARIANTS = pytest.mark.parametrize("variant", list(SKINNY_VARIANTS.values()), ids=list(SKINNY_VARIANTS))


@VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 1, 1), (1, 7, 15), (3, 33, 17), (5, 9, 100),
                                                           (8, 64, 48), (13, 5, 31), (1, 130, 2048), (2, 203, 70)])
def test_skinny_linear_matches_f_linear(native, dtype, rows, out_features, in_features, variant):
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    got = native.skinny_linear(x, w, None, bias, *variant)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = F.linear(x.float(), w.float(), bias.float())  # what torch's CPU linear computes before rounding
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 37, 64), (3, 130, 200), (5, 9, 1000)])
def test_skinny_linear_rounds_the_sum_and_the_bias_once(native, dtype, rows, out_features, in_features, variant):
    # Small integers: every float32 sum is exact (up to ~10^4, beyond bf16's and fp16's integers), so y must be
    # exactly (sum + bias) rounded once to x's dtype, as torch's CPU linear rounds it; rounding the sum first and
    # then the sum with the bias would differ.
    g = torch.Generator().manual_seed(rows + in_features)
    x = torch.randint(-8, 9, (rows, in_features), generator=g).to(dtype)
    w = torch.randint(-8, 9, (out_features, in_features), generator=g).to(dtype)
    bias = torch.randint(-300, 301, (out_features,), generator=g).to(dtype)
    want = (x.double() @ w.double().T + bias.double()).to(dtype)
    assert torch.equal(native.skinny_linear(x, w, None, bias, *variant), want)
    assert torch.equal(native.skinny_linear(x, w, None, None, *variant), (x.double() @ w.double().T).to(dtype))
    int8 = native.skinny_linear(x, w.to(torch.int8), torch.ones(out_features), bias, *variant)  # x paired for bf16
    assert torch.equal(int8, want)


@VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 3, 5), (2, 17, 40), (7, 33, 129), (1, 6, 256),
                                                           (5, 4, 200), (1, 75, 64)])
def test_skinny_linear_int8_is_the_dequantized_product(native, dtype, rows, out_features, in_features, variant):
    g = torch.Generator().manual_seed(rows + out_features)
    weight = Int8Weight.quantize(torch.randn(out_features, in_features, generator=g))
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    got = native.skinny_linear(x, weight.qweight, weight.scale, None, *variant)
    want = F.linear(x.float(), weight.dequantize(torch.float32))
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


def test_skinny_linear_refuses_mismatched_shapes(native):
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\]"):
        native.skinny_linear(torch.ones(1, 4), torch.ones(3, 5), None, None)
    with pytest.raises(RuntimeError, match="scale goes with int8"):
        native.skinny_linear(torch.ones(1, 4), torch.ones(3, 4), torch.ones(3), None)
    with pytest.raises(RuntimeError, match="rows in flight must be 1 or 4"):
        native.skinny_linear(torch.ones(1, 4), torch.ones(3, 4), None, None, 2)
    with pytest.raises(RuntimeError, match="non_temporal names the prefetch of 4 rows in flight"):
        native.skinny_linear(torch.ones(1, 4), torch.ones(3, 4), None, None, 1, True)
    with pytest.raises(RuntimeError, match="parts names 4 rows in flight, one from each quarter"):
        native.skinny_linear(torch.ones(1, 4), torch.ones(3, 4), None, None, 1, False, True)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16, not Double"):
        native.skinny_linear(torch.ones(1, 4, dtype=torch.float64), torch.ones(3, 4), None, None)
    with pytest.raises(RuntimeError, match="bias must have one entry per output row"):
        native.skinny_linear(torch.ones(1, 4), torch.ones(3, 4), None, torch.ones(2))


def decode_case(dtype, num_seqs=3, heads=6, kv_heads=2, head_dim=24, block_size=4, context_lens=(1, 9, 17)):
    # A pool with more blocks than needed, each sequence's blocks scattered through it.
    g = torch.Generator().manual_seed(head_dim + len(context_lens))
    max_blocks = max(-(-n // block_size) for n in context_lens)
    num_blocks = max(16, num_seqs * max_blocks + 4)
    cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)
    tables = order[: num_seqs * max_blocks].view(num_seqs, max_blocks).contiguous()
    q = torch.randn(num_seqs, heads, head_dim, generator=g).to(dtype)
    return q, cache, AttentionMetadata.for_decode(list(context_lens), tables, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# query heads per task (Q) of 3, 2, 8, 4, 6, 20 and 16: every layout of the softmax's lanes (Q divides 8, 8
# divides Q, neither) and both head-dim paths (a multiple of 16 or not); on AVX2 the chunked path's head dims
# from 16 to its largest, 256, and 5 query heads per kv head (a group of 4, then 1); on AVX-512 the runs' value
# loops for 1 to 4 heads and 1 to 4 vectors at a time; with AVX512-BF16 the bf16 pairs path (decode_pairs.h) for
# 1 to 8 registers of pairs, 1 to 4 heads a row pair (G 5: 4, then 1; G 3) and 64 dims, then 32 (Dh 96)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 24), (4, 4, 16), (8, 1, 64), (8, 2, 32), (12, 2, 16),
                                                     (40, 2, 16), (32, 2, 64), (10, 2, 48), (16, 4, 128), (4, 1, 256),
                                                     (10, 2, 64), (6, 2, 96)])
def test_paged_decode_attention_matches_the_gather_and_sdpa_reference(native, dtype, heads, kv_heads, head_dim):
    q, cache, meta = decode_case(dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    got = native.paged_decode_attention(q, cache, meta.block_tables, meta.context_lens_tensor, meta.block_size, 0.3)
    want = torch_decode_attention(q.float(), cache.float(), meta, 0.3)
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (12, 4, 16), (6, 2, 24)])
def test_paged_decode_attention_does_not_depend_on_the_batch_or_the_threads(native, dtype, heads, kv_heads,
                                                                            head_dim):
    # The kernel groups kv heads into tasks by batch size and thread count (a head per task, several, whole rows):
    # a sequence's output must be bit for bit the same alone, in a batch, on 1, 2 or 3 threads.
    q, cache, meta = decode_case(dtype, num_seqs=5, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                 block_size=16, context_lens=(70, 1, 33, 130, 16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = native.paged_decode_attention(q, cache, meta.block_tables, meta.context_lens_tensor, 16, 0.3)
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for i in range(5):
                alone = native.paged_decode_attention(q[i : i + 1], cache, meta.block_tables[i : i + 1],
                                                      meta.context_lens_tensor[i : i + 1], 16, 0.3)
                assert torch.equal(alone[0], batch[i]), (n, i)
            for size in (2, 3):
                part = native.paged_decode_attention(q[:size], cache, meta.block_tables[:size],
                                                     meta.context_lens_tensor[:size], 16, 0.3)
                assert torch.equal(part, batch[:size]), (n, size)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,scale", [(32, 0.3), (16, 0.3), (32, 8.0)])
def test_paged_decode_attention_over_long_contexts(native, dtype, block_size, scale):
    # Blocks longer than the AVX2 path's 16-token chunk, contexts of many chunks ending mid-chunk, and (scale 8)
    # scores tens apart: a running maximum that rises from chunk to chunk, exponentials that underflow to zero.
    q, cache, meta = decode_case(dtype, num_seqs=3, heads=8, kv_heads=2, head_dim=64, block_size=block_size,
                                 context_lens=(1, 40, 17 * 16 + 3 if block_size == 16 else 250))
    got = native.paged_decode_attention(q, cache, meta.block_tables, meta.context_lens_tensor, block_size, scale)
    want = torch_decode_attention(q.float(), cache.float(), meta, scale)
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


def test_paged_decode_attention_reads_only_the_context(native):
    # Poisoning every slot outside the sequences' contexts must not change the answer.
    q, cache, meta = decode_case(torch.float32)
    before = native.paged_decode_attention(q, cache, meta.block_tables, meta.context_lens_tensor, 4, 0.5)
    used = {int(meta.block_tables[b, t // 4]) * 4 + t % 4 for b, n in enumerate(meta.context_lens) for t in range(n)}
    poisoned = cache.clone()
    for slot in set(range(cache.shape[1])) - used:
        poisoned[:, slot] = float("nan")
    after = native.paged_decode_attention(q, poisoned, meta.block_tables, meta.context_lens_tensor, 4, 0.5)
    assert torch.equal(before, after)


def prefill_case(dtype, new_tokens, context_len, heads, kv_heads, head_dim, block_size=16, seed=0):
    """One sequence's queries [T, H, Dh], a pool [2, S, K, Dh] holding its context in scattered
    blocks (more blocks than it needs), and its block table."""
    g = torch.Generator().manual_seed(seed + new_tokens + context_len + head_dim)
    used, num_blocks = -(-context_len // block_size), -(-context_len // block_size) + 5
    cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:used].contiguous()
    q = torch.randn(new_tokens, heads, head_dim, generator=g).to(dtype)
    return q, cache, table


def prefill_reference(q, cache, table, context_len, block_size, scale):
    """The context gathered out of the pool, then SDPA in float32: query j at position
    context_len - T + j sees keys 0 .. that position."""
    new_tokens = q.shape[0]
    slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:context_len]
    keys, values = cache[0, slots].transpose(0, 1).float(), cache[1, slots].transpose(0, 1).float()  # [K, C, Dh]
    positions = torch.arange(context_len - new_tokens, context_len)
    mask = torch.arange(context_len)[None, :] <= positions[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).float()[None], keys[None], values[None], attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)  # [T, H, Dh]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("new_tokens,context_len,heads,kv_heads,head_dim", [
    (1, 1, 4, 4, 16),  # one token, GQA ratio 1
    (37, 37, 6, 2, 64),  # a whole prompt, T a multiple of no block, ratio 3
    (70, 201, 12, 3, 64),  # a later chunk after a cached prefix of 131, ratio 4
    (33, 33, 3, 1, 24),  # an odd head dim (16 lanes + 8 left over), ratio 3
    (50, 90, 8, 2, 40),
    (5, 77, 4, 4, 16),  # a short chunk far into its context
    (150, 150, 8, 2, 64),  # several key blocks, the diagonal inside them
    (96, 300, 4, 1, 32),  # ratio 4 after a prefix, the chunk starting mid-block
    (9, 9, 2, 1, 20),  # a head dim past whole vectors (16 + 4 with AVX-512, 16 + 4 with AVX2: scalar columns)
])
def test_prefill_attention_matches_the_gather_and_sdpa_reference(native, dtype, new_tokens, context_len, heads,
                                                                 kv_heads, head_dim):
    q, cache, table = prefill_case(dtype, new_tokens, context_len, heads, kv_heads, head_dim)
    got = native.prefill_attention(q, cache, table, context_len, 16, 0.3)
    assert got.dtype == dtype and got.shape == q.shape
    want = prefill_reference(q, cache, table, context_len, 16, 0.3)
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_only_the_context(native, dtype):
    # Every slot past the context, in its last block and in blocks it does not use, poisoned with NaN.
    q, cache, table = prefill_case(dtype, 20, 45, 4, 2, 32, block_size=8)
    before = native.prefill_attention(q, cache, table, 45, 8, 0.5)
    used = {int(table[t // 8]) * 8 + t % 8 for t in range(45)}
    poisoned = cache.clone()
    for slot in set(range(cache.shape[1])) - used:
        poisoned[:, slot] = float("nan")
    after = native.prefill_attention(q, poisoned, table, 45, 8, 0.5)
    assert torch.equal(before, after)


def test_prefill_attention_reads_a_strided_view_of_the_qkv_product(native):
    # the model hands q over as heads 0..H-1 of the fused qkv rows [T, H + 2K, Dh], not a copy
    q, cache, table = prefill_case(torch.bfloat16, 19, 40, 6, 2, 32)
    qkv = torch.cat([q, torch.full((19, 4, 32), float("nan"), dtype=torch.bfloat16)], dim=1)
    assert not qkv[:, :6].is_contiguous()
    assert torch.equal(native.prefill_attention(qkv[:, :6], cache, table, 40, 16, 0.3),
                       native.prefill_attention(q, cache, table, 40, 16, 0.3))


def test_prefill_attention_refuses_what_it_cannot_read(native):
    q, cache, table = prefill_case(torch.float32, 4, 40, 4, 2, 16)  # 40 slots of 16: 3 blocks
    with pytest.raises(RuntimeError, match="context_len 3 must cover the 4 queries"):
        native.prefill_attention(q, cache, table, 3, 16, 1.0)
    with pytest.raises(RuntimeError, match="context_len 64 needs 4 blocks, the table has 3"):
        native.prefill_attention(q, cache, table, 64, 16, 1.0)
    with pytest.raises(RuntimeError, match="block 99 is outside the pool"):
        native.prefill_attention(q, cache, torch.tensor([0, 99, 1]), 40, 16, 1.0)
    with pytest.raises(RuntimeError, match="K must divide H"):
        native.prefill_attention(q[:, :3], cache, table, 40, 16, 1.0)
    with pytest.raises(RuntimeError, match="scale must be positive, got 0"):
        native.prefill_attention(q, cache, table, 40, 16, 0.0)


def test_load_returns_none_and_says_why_when_compiling_fails(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", broken)
    native_build.load.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert native_build.load() is None
        assert "native CPU kernels unavailable, using torch's (RuntimeError: Ninja is required" in caplog.text
    finally:
        native_build.load.cache_clear()


LOCK_WAIT_SECONDS = 120  # the build is there already (the `native` fixture): a load takes about a second


def test_a_build_killed_midway_does_not_block_the_next_load(native, caplog):
    # torch's file lock, as a build killed before it finished leaves it: load() would wait on it forever
    stale = native_build.cache_root() / "kernels" / native_build.build_key() / "lock"
    stale.touch()
    native_build.load.cache_clear()
    loaded = []
    try:
        with caplog.at_level("WARNING"):
            # on a thread, so a load that waits on the lock fails the test instead of hanging it
            loader = threading.Thread(target=lambda: loaded.append(native_build.load()), daemon=True)
            loader.start()
            loader.join(timeout=LOCK_WAIT_SECONDS)
        assert loaded and loaded[0] is not None, "load() still waits on the killed build's lock"
        assert f"removing {stale}, left by a native kernel build that was killed" in caplog.text
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)
        native_build.load.cache_clear()


def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    native_build.load.cache_clear()
    try:
        assert native_build.load() is None
    finally:
        native_build.load.cache_clear()


def test_another_march_target_is_its_own_build_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.delenv(native_build.MARCH_ENV, raising=False)
    here = native_build.build_key()
    assert native_build.cflags() == ("-O3", "-march=native", "-fopenmp")
    monkeypatch.setenv(native_build.MARCH_ENV, "znver3")
    assert native_build.cflags() == ("-O3", "-march=znver3", "-fopenmp")
    assert native_build.build_key() != here  # cached apart from the host's own build
    monkeypatch.setenv(native_build.MARCH_ENV, "native -O0")
    with pytest.raises(ValueError, match="PDSERVE_NATIVE_MARCH must be a -march target such as native, znver3 or "
                                         "x86-64-v3, got 'native -O0'"):
        native_build.build_key()


def test_every_source_beside_the_build_is_part_of_its_key():
    # a header left out of the key would leave a stale cached build after it changed
    folder = Path(native_build.__file__).parent
    assert sorted(native_build.SOURCES) == sorted(p.name for p in folder.glob("*.cpp"))
    assert sorted(native_build.HEADERS) == sorted(p.name for p in folder.glob("*.h"))
