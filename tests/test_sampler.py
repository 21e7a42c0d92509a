"""Sampling: exact filter and penalty arithmetic, and seeded draws that depend only on (seed, position)."""

from __future__ import annotations

import math

import pytest
import torch

from services import Engine, SamplingParams
from services.sampler import _apply_penalties_and_bias, _filtered_probs, exponential_noise, sample
from services.sequence import Sequence


def make_seq(token_ids, num_prompt, **params) -> Sequence:
    return Sequence("s", list(token_ids), num_prompt, SamplingParams(**params), seed=params.get("seed") or 0,
                    arrival_order=0)


def test_top_k_top_p_min_p_filters_exactly():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = _filtered_probs(logits, [SamplingParams(top_p=0.8)])
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = _filtered_probs(logits, [SamplingParams(top_k=3)])
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    p = _filtered_probs(logits, [SamplingParams(min_p=0.5)])  # keep p >= 0.25
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = _filtered_probs(logits, [SamplingParams(temperature=0.5)])
    sq = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    torch.testing.assert_close(p, (sq / sq.sum())[None])


def test_penalties_bias_and_min_tokens_arithmetic():
    row = torch.tensor([1.0, -1.0, 2.0, 0.5, 3.0])
    seq = make_seq([0, 1, 2, 2], 2, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                   logit_bias={3: 10.0}, min_tokens=5, stop_token_ids=(4,))
    _apply_penalties_and_bias(row, seq, eos_token_ids=(1,))
    # token 0: seen in prompt -> 1/2. token 1: eos, banned (min_tokens). token 2: output twice ->
    # 2/2 - 0.25*2 - 0.5. token 3: +10 bias. token 4: stop token id, banned.
    assert row.tolist() == [0.5, -math.inf, 0.0, 10.5, -math.inf]


def test_noise_is_a_pure_function_of_seed_and_position():
    a = exponential_noise([7, 7, 8], [10, 11, 10], 1000, torch.device("cpu"))
    b = exponential_noise([8, 7], [10, 11], 1000, torch.device("cpu"))
    assert torch.equal(a[2], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a > 0).all()


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(4000, 4).clone()
    seqs = [make_seq([1] * (i % 50 + 1), 1, temperature=1.0, seed=i // 50) for i in range(4000)]
    counts = torch.bincount(torch.tensor([t.token_id for t in sample(logits, seqs, ())]), minlength=4)
    freqs = counts / 4000
    # 4000 draws: three standard errors of the largest frequency is about 0.024
    assert (freqs - probs).abs().max() < 0.03, freqs


@pytest.fixture(scope="module")
def engine(tiny_path):
    return Engine(model=tiny_path)


def test_same_seed_same_tokens_alone_or_batched(engine):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine.generate([[1, 10, 20, 30]], params)[0].token_ids
    others = SamplingParams(max_tokens=30, temperature=0.7, seed=5, ignore_eos=True)
    batched = engine.generate([[1, 99], [1, 10, 20, 30], [1, 5, 6, 7, 8]], [others, params, others])
    assert batched[1].token_ids == alone
    assert engine.generate([[1, 10, 20, 30]], SamplingParams(**{**params.__dict__, "seed": 99}))[0].token_ids != alone


def test_resuming_at_a_position_continues_identically(engine):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=77, ignore_eos=True)
    prompt = [1, 40, 41, 42]
    whole = engine.generate([prompt], params)[0].token_ids
    resumed = engine.generate([prompt + whole[:12]], SamplingParams(**{**params.__dict__, "max_tokens": 18}))[0]
    assert resumed.token_ids == whole[12:]


def test_resuming_with_output_tokens_keeps_penalties_and_limits(engine):
    """A stream resumed on another worker: the delivered tokens count as output, not prompt, so
    penalties over output tokens, min_tokens and max_tokens go on exactly as before."""
    eos = engine.model_config.eos_token_ids[0]
    # Tokens 5, 6 and 7 are favoured, so they repeat and the output penalties decide the draws.
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=5, presence_penalty=1.5, frequency_penalty=0.8,
                            min_tokens=20, logit_bias={eos: 10.0, 5: 12.0, 6: 12.0, 7: 12.0})
    prompt = [1, 40, 41, 42]
    whole = engine.generate([prompt], params)[0]
    assert 20 < len(whole.token_ids) < 30 and whole.finish_reason == "stop"  # EOS held back, then taken
    for k in (1, 12, 19):
        engine.add_request(f"resume-{k}", prompt, params, output_token_ids=whole.token_ids[:k])
        tokens = []
        while engine.has_unfinished_requests:
            for out in engine.step():
                tokens += out.new_token_ids
                reason = out.finish_reason
        assert tokens == whole.token_ids[k:] and reason == "stop"
    as_prompt = SamplingParams(**{**params.__dict__, "max_tokens": 18, "min_tokens": 8})
    plain = engine.generate([prompt + whole.token_ids[:12]], as_prompt)
    assert plain[0].token_ids != whole.token_ids[12:]  # as prompt tokens they would not be penalised
    with pytest.raises(ValueError, match="already"):
        engine.add_request("done", prompt, params, output_token_ids=[5] * 30)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", prompt, params, output_token_ids=[10**6])


def test_top_k_one_is_greedy_and_bias_forces_a_token(engine):
    prompt = [1, 7, 8, 9]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    top1 = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids
    forced = engine.generate([prompt], SamplingParams(max_tokens=5, logit_bias={77: 100.0}))[0]
    assert forced.token_ids == [77] * 5


def test_min_tokens_holds_back_eos_then_stops_on_it(engine):
    eos = engine.model_config.eos_token_ids[0]
    out = engine.generate([[1, 3]], SamplingParams(max_tokens=20, min_tokens=6, logit_bias={eos: 100.0}))[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and eos not in out.token_ids[:6]
    assert out.finish_reason == "stop"
    stop_id = engine.generate([[1, 3]], SamplingParams(max_tokens=20, logit_bias={33: 100.0},
                                                       stop_token_ids=(33,)))[0]
    assert stop_id.token_ids == [33] and stop_id.finish_reason == "stop"


def test_logprobs_are_raw_log_softmax_with_top_alternatives(engine):
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) == 3  # greedy token is the top one, so it is among the three
        assert lp[token] == max(lp.values())
        assert all(v <= 0 for v in lp.values())
