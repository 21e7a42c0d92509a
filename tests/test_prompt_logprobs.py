"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob given the ones
before it, as transformers computes it on the same weights, with chunked prefill and a warm cache."""

from __future__ import annotations

import pytest
import torch

from services import Engine, SamplingParams

PROMPT = [1] + [17 + (7 * i) % 450 for i in range(39)]  # 40 tokens: two whole blocks and a half


@pytest.fixture(scope="module")
def expected(tiny_path) -> list[dict[int, float]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    out = []
    for i in range(len(PROMPT) - 1):
        entry = {PROMPT[i + 1]: logprobs[i, PROMPT[i + 1]].item()}
        top = torch.topk(logprobs[i], 3)
        entry.update(zip(top.indices.tolist(), top.values.tolist()))
        out.append(entry)
    return out


def _check(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want) == len(PROMPT) - 1
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}])
def test_prompt_logprobs_equal_transformers(tiny_path, expected, options):
    engine = Engine(model=tiny_path, **options)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    first = engine.generate([PROMPT], params)[0]
    _check(first.prompt_logprobs, expected)
    again = engine.generate([PROMPT], params)[0]  # the blocks are cached now, but have no logits
    assert again.num_cached_tokens == 0
    _check(again.prompt_logprobs, expected)
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == 32
    assert plain.token_ids == first.token_ids == again.token_ids


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
