"""A prompt sharing a cached prefix computes only its suffix and produces the same tokens."""

from __future__ import annotations

import torch

from services import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_shared_prefix_computes_only_the_suffix(tiny_path):
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 500, (50,), generator=g).tolist()  # 3 full blocks of 16 + 2 tokens
    first, second = prefix + [7, 8, 9], prefix + [10, 11]
    cold = Engine(model=tiny_path, enable_prefix_caching=False).generate([second], GREEDY)[0]

    engine = Engine(model=tiny_path)
    engine.generate([first], GREEDY)
    fed = []
    original = engine.runner.run

    def counting_run(batch):
        fed.append(sum(batch.num_new_tokens))
        return original(batch)

    engine.runner.run = counting_run
    warm = engine.generate([second], GREEDY)[0]
    assert warm.num_cached_tokens == 48  # the three full shared blocks
    assert fed[0] == len(second) - 48  # the first step fed only the suffix
    assert warm.token_ids == cold.token_ids
    assert engine.block_manager.num_prefix_hits == 48


def test_identical_prompt_recomputes_only_its_last_block(tiny_path):
    prompt = list(range(3, 3 + 32))  # exactly two blocks
    engine = Engine(model=tiny_path)
    a = engine.generate([prompt], GREEDY)[0]
    b = engine.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == 16 and a.token_ids == b.token_ids


def test_prefix_cache_across_a_concurrent_batch_matches_cold(tiny_path):
    base = list(range(100, 140))
    prompts = [base + [i, i + 1] for i in range(3, 9)]
    cold = Engine(model=tiny_path, enable_prefix_caching=False).generate(prompts, GREEDY)
    engine = Engine(model=tiny_path, max_num_batched_tokens=64)
    engine.generate([base + [1]], GREEDY)
    warm = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert all(o.num_cached_tokens == 32 for o in warm)
