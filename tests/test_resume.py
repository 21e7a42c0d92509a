"""A restarted stream is a new request to the workers: its own id, the prompt plus what was delivered."""

from __future__ import annotations

from router.orchestrator import _resumed
from services.protocol import DecodeRequest
from services.sampling_params import SamplingParams


def test_each_restart_has_an_id_of_its_own_and_carries_the_delivered_tokens():
    params = SamplingParams(max_tokens=9, seed=3, logprobs=1, prompt_logprobs=2)
    original = DecodeRequest("cmpl-7-0", [1, 2, 3], params, first_token_id=5)
    once = _resumed(original, [5, 6])
    twice = _resumed(once, [5, 6])  # failed again before a token: same delivered tokens, new id
    ids = [original.request_id, once.request_id, twice.request_id]
    assert len(set(ids)) == 3 and all(i.startswith("cmpl-7-0/resume-") for i in ids[1:])
    assert twice.request_id.count("/resume-") == 1  # the base id, not a chain
    assert (once.prompt_token_ids, once.output_token_ids, once.first_token_id) == ([1, 2, 3], [5, 6], None)
    assert once.params.prompt_logprobs is None and once.params.logprobs == 1 and once.params.seed == 3
