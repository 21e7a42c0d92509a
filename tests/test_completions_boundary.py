"""What /v1/completions and /detokenize take and give at their edges, through a real router on the
split path: token ids are strict integers in range."""

from __future__ import annotations

import httpx
import pytest
from cluster_harness import router_server, two_node_cluster

from router.launcher import ClusterSpec


@pytest.fixture(scope="module")
def server(tiny_path):
    with two_node_cluster():
        # Known ceilings given: the workers skip their start-up probe.
        spec = ClusterSpec(model=str(tiny_path), namespace="pd-edges", peak_flops=2e12, peak_bytes_per_second=5e10,
                           engine_options={"num_threads": 1, "max_num_seqs": 8})
        with router_server(spec) as (url, actors, _):
            yield url, actors, str(tiny_path)


CHAT = [{"role": "user", "content": "hi"}]
BAD_TOKEN_IDS = [
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 5], [6, True]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 5.0]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 5}}, "logit_bias"),  # "²".isdigit()
    ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [False]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"-1": 5}}, "logit_bias"),
    ("/detokenize", {"tokens": [True, 5]}, "tokens"),
    ("/detokenize", {"tokens": [5, 99999]}, "tokens"),
]


def test_token_ids_are_strict_integers_in_range(server):
    url, _, _ = server
    for path, body, param in BAD_TOKEN_IDS:
        response = httpx.post(url + path, json={"max_tokens": 2, **body}, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"] == {"message": response.json()["error"]["message"], "param": param,
                                            "type": "BadRequestError", "code": 400}, body
    message = httpx.post(url + "/v1/completions", json={"prompt": [[False]]}).json()["error"]["message"]
    assert "true and false are not" in message
    # ...while the same shapes with integers are served
    assert httpx.post(url + "/detokenize", json={"tokens": [1, 5]}).status_code == 200
    for body in ({"prompt": [[1, 5], [6, 7]]}, {"prompt": "hi", "stop_token_ids": [3], "logit_bias": {"5": 1}}):
        assert httpx.post(url + "/v1/completions", json={"max_tokens": 2, **body}, timeout=60).status_code == 200
