"""Greedy tokens on the trained stories260K checkpoint equal transformers', whatever the batching."""

from __future__ import annotations

import pytest
import torch

from services import Engine, SamplingParams

NUM_NEW = 24
# Lengths around the 16-token block: shorter than a block, exactly one, several, and a long one.
PROMPT_LENGTHS = [1, 7, 16, 33, 120, 230]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 512, (n - 1,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(stories_path) -> list[list[int]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(stories_path, torch_dtype=torch.float32).eval()
    outs = []
    for p in prompts():
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_NEW,
                             min_new_tokens=NUM_NEW, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs


GREEDY = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0)


def test_first_greedy_tokens_match_the_reference_c_implementation(stories_path):
    engine = Engine(model=stories_path)
    out = engine.generate([[1]], SamplingParams(max_tokens=10, temperature=0))[0]
    assert out.token_ids == [461, 461, 401, 401, 401, 461, 378, 455, 473, 456]
    assert out.text == " ".join(f"⟨{t}⟩" for t in out.token_ids)


# "native": the native CPU kernels (skinny matmuls, paged decode attention) wherever they run; "torch":
# torch's only. Both must give transformers' tokens.
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_one_at_a_time(stories_path, expected, kernels):
    engine = Engine(model=stories_path, enable_prefix_caching=False, kernels=kernels)
    for p, want in zip(prompts(), expected):
        assert engine.generate([p], GREEDY)[0].token_ids == want


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_batched(stories_path, expected, kernels):
    engine = Engine(model=stories_path, kernels=kernels)
    assert [o.token_ids for o in engine.generate(prompts(), GREEDY)] == expected


def test_chunked_prefill(stories_path, expected):
    engine = Engine(model=stories_path, max_num_batched_tokens=24, max_num_seqs=8)
    assert [o.token_ids for o in engine.generate(prompts(), GREEDY)] == expected


def test_preemption_under_a_tiny_pool(stories_path, expected):
    # 18 blocks of 16 tokens: the 230-token prompt alone needs 16 of them, so others get preempted.
    engine = Engine(model=stories_path, num_kv_blocks=18, enable_prefix_caching=False)
    outs = engine.generate(prompts(), GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert engine.block_manager.num_free_blocks == 18


def test_text_prompt_gets_bos(stories_path):
    engine = Engine(model=stories_path)
    out = engine.generate(["⟨45⟩ ⟨300⟩"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.prompt_token_ids == [1, 45, 300]
    same = engine.generate([[1, 45, 300]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.token_ids == same.token_ids
