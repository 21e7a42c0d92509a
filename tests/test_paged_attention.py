"""`paged_attention` on a mixed step: sequences that prefill (whole prompts or later chunks) beside
sequences that decode one token, which go to the decode kernel as one batch."""

import pytest
import torch
import torch.nn.functional as F

from services.attention import AttentionMetadata, paged_attention, torch_decode_attention
from services.kernels import native as native_build

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
# (new tokens, context after the step) per sequence: a decode, a whole prompt, a decode of a
# one-token context, a later prompt chunk, a decode
STEP = [(1, 9), (5, 5), (1, 1), (3, 11), (1, 6)]


def mixed_step(seed: int = 0):
    """The pool holding every sequence's earlier KV, the step's q/k/v, its metadata, and each
    sequence's whole k/v [T, K, Dh] (earlier + new) for the reference."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 24
    pool = torch.randn(2, num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, whole = [], [], []
    for new, context in STEP:
        blocks = [order.pop() for _ in range(-(-context // BLOCK))]
        tables.append(blocks + [0] * (3 - len(blocks)))
        seq_slots = [blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(context)]
        slots += seq_slots[context - new:]
        whole.append(seq_slots)
    n = sum(new for new, _ in STEP)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g), torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
    meta = AttentionMetadata(torch.tensor(slots), [new for new, _ in STEP], [c for _, c in STEP], torch.tensor(tables),
                             BLOCK, None)
    return pool, q, k, v, meta, whole


def reference(pool: torch.Tensor, q: torch.Tensor, whole: list[list[int]], scale: float) -> torch.Tensor:
    """Each sequence's queries against its whole context (the pool after the step's writes), causally."""
    out, start = [], 0
    for (new, context), seq_slots in zip(STEP, whole):
        keys = pool[0, seq_slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)  # [H, T, Dh]
        values = pool[1, seq_slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        mask = torch.arange(context)[None, :] <= torch.arange(context - new, context)[:, None]
        o = F.scaled_dot_product_attention(q[start:start + new].transpose(0, 1), keys, values, attn_mask=mask,
                                           scale=scale)
        out.append(o.transpose(0, 1))
        start += new
    return torch.cat(out)


def native_decode_kernel():
    module = native_build.load()
    if module is None:
        pytest.skip("this host cannot compile the native kernels (the engine falls back to torch's)")

    def kernel(q, kv_cache, meta, scale):
        return module.paged_decode_attention(q, kv_cache, meta.block_tables, meta.context_lens_tensor,
                                             meta.block_size, scale)
    return kernel


def native_prefill_kernel():
    module = native_build.load()
    if module is None:
        pytest.skip("this host cannot compile the native kernels (the engine falls back to torch's)")
    return module.prefill_attention


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_a_mixed_step_equals_each_sequence_attending_alone(kernel):
    pool, q, k, v, meta, whole = mixed_step()
    decode_kernel = torch_decode_attention if kernel == "torch" else native_decode_kernel()
    prefill_kernel = None if kernel == "torch" else native_prefill_kernel()
    got = paged_attention(q, k, v, pool, meta, 0.25, decode_kernel, prefill_kernel)
    torch.testing.assert_close(got, reference(pool, q, whole, 0.25), rtol=1e-5, atol=1e-5)


def test_the_prefill_kernel_gets_each_multi_token_sequence_with_its_own_table():
    pool, q, k, v, meta, whole = mixed_step()
    calls = []

    def recording(q_i, kv_cache, block_table, context_len, block_size, scale):
        calls.append((q_i.shape[0], block_table.tolist(), context_len, block_size, scale))
        assert kv_cache is pool and torch.equal(q_i, q[1:6] if len(calls) == 1 else q[7:10])
        return torch.zeros_like(q_i)

    got = paged_attention(q, k, v, pool, meta, 0.25, torch_decode_attention, recording)
    assert calls == [(5, meta.block_tables[1].tolist(), 5, BLOCK, 0.25), (3, meta.block_tables[3].tolist(), 11, BLOCK, 0.25)]
    want = reference(pool, q, whole, 0.25)
    assert torch.equal(got[1:6], torch.zeros(5, HEADS, HEAD_DIM)) and torch.equal(got[7:10], torch.zeros(3, HEADS, HEAD_DIM))
    torch.testing.assert_close(got[[0, 6, 10]], want[[0, 6, 10]], rtol=1e-5, atol=1e-5)  # the decodes unaffected


def test_the_decode_rows_are_found_once_per_step():
    _, _, _, _, meta, _ = mixed_step()
    rows, decode_meta = meta.decode_part()
    assert rows.tolist() == [0, 6, 10]  # flat rows of the three one-token sequences
    assert decode_meta.context_lens == [9, 1, 6] and decode_meta.context_lens_tensor.tolist() == [9, 1, 6]
    assert decode_meta.block_tables.tolist() == [meta.block_tables[i].tolist() for i in (0, 2, 4)]
    assert decode_meta.decode_mask.shape == (3, 1, 1, 9) and decode_meta.decode_mask.sum().item() == 16
    assert meta.decode_part()[0] is rows  # every layer reuses the first layer's


def test_a_step_without_decodes_has_no_decode_part():
    meta = AttentionMetadata(torch.tensor([0, 1]), [2], [2], torch.tensor([[0]]), BLOCK, None)
    assert meta.decode_part() is None
