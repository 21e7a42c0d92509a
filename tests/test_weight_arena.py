"""Weights copied into the huge-page arena are the same bytes, aligned, and what the model reads."""

from __future__ import annotations

import mmap

import pytest
import torch

from services import Engine
from services.int4_weight import Int4Weight
from services.quantized_weight import Int8Weight
from services.weight_arena import ALIGN, HUGE_PAGE, HugePageArena

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")


def test_copies_are_exact_and_aligned():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 5, generator=g).bfloat16(), torch.randint(-127, 128, (3, 33), dtype=torch.int8),
               torch.randn(100, generator=g)]
    arena = HugePageArena.create(sum(HugePageArena.size_of(t) for t in tensors))
    copies = [arena.copy(t) for t in tensors]
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    for original, copy in zip(tensors, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.data_ptr() % ALIGN == 0
    with pytest.raises(AssertionError, match="sized for fewer bytes"):
        arena.copy(torch.ones(1))


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "w4a8"])
def test_the_model_streams_its_matrices_from_the_arena(tiny_path, quantization):
    model = Engine(tiny_path, quantization=quantization).runner.model

    def data(w):
        return w.qweight if isinstance(w, Int8Weight) else w.packed if isinstance(w, Int4Weight) else w

    matrices = [data(model.lm_head)] + [data(getattr(layer, n)) for layer in model.layers
                                        for n in ("qkv", "o", "gate_up", "down")]
    starts = sorted(m.data_ptr() for m in matrices)
    assert starts[0] % HUGE_PAGE == 0  # one mapping, from a 2 MB boundary, tensors side by side
    assert starts[-1] - starts[0] < sum(HugePageArena.size_of(m) for m in matrices)
    if quantization is None and model.config.tie_word_embeddings:
        assert model.embed is model.lm_head


def test_zeros_is_a_zeroed_tensor_of_its_own_from_a_huge_page_boundary():
    first = HugePageArena.zeros((3, 2, 5, 4), torch.bfloat16)
    second = HugePageArena.zeros((7,), torch.float32)
    assert first.shape == (3, 2, 5, 4) and first.dtype == torch.bfloat16 and not first.any()
    assert first.data_ptr() % HUGE_PAGE == 0 and second.data_ptr() % HUGE_PAGE == 0
    first[1, 1].fill_(2.5)  # writable, and only the written slots change
    assert first.float().sum().item() == 2.5 * 20 and not second.any()


def test_the_engine_keeps_its_kv_pool_in_the_arena(tiny_path):
    runner = Engine(tiny_path).runner
    assert runner.kv_cache.data_ptr() % HUGE_PAGE == 0 and runner.kv_cache.is_contiguous()
    assert runner.kv_slots.data_ptr() == runner.kv_cache.data_ptr()


def test_an_arena_gives_back_the_whole_pages_of_a_copy_alone():
    arena = HugePageArena.create(3 * (1 << 20))
    if arena is None:
        pytest.skip("this platform has no madvise(MADV_HUGEPAGE)")
    parts = [arena.copy(torch.full((n,), v, dtype=torch.uint8)) for n, v in ((1000, 1), (1 << 20, 2), (5000, 3))]
    start = parts[1].data_ptr() - parts[0].data_ptr()  # 1024: the first part's bytes, rounded to a cache line
    released = arena.release(parts[1])
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    assert released == (start + (1 << 20)) // mmap.PAGESIZE * mmap.PAGESIZE - first
    assert int(parts[0].sum()) == 1000 and int(parts[2].sum()) == 3 * 5000  # the neighbours keep their bytes
    freed = parts[1][first - start : first - start + released]
    assert int(freed.count_nonzero()) == 0 and int(parts[1][: first - start].min()) == 2  # a shared page stays
