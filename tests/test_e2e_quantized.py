"""Prefill workers that round activations to int8 and weight-only decode workers of the same weights, on separate
nodes: `--prefill-quantization w8a8 --decode-quantization int8` and `w4a8` / `int4` (int8 activations where prefill
is compute-bound, weight-only products where decode streams weights): over HTTP, every answer is what the same two
engines give when KV is handed over in-process, and each worker reports its own weight format."""

from __future__ import annotations

import e2e_checks as checks
import pytest
import ray
from cluster_harness import router_server, two_node_cluster
from openai import OpenAI

from router.launcher import ClusterSpec
from services import Engine, SamplingParams
from services.scheduler import SampledToken
from services.tokenizer import Tokenizer

# (prefill format, decode format) -> the products only the prefill workers run
PRODUCTS = {("w8a8", "int8"): {"int8.dynamic", "native.w8a8"}, ("w4a8", "int4"): {"native.w4a8", "x8.dequant.linear"}}


@pytest.fixture(scope="module", params=list(PRODUCTS), ids="-".join)
def server(tiny_path, request):
    prefill, decode = request.param
    with two_node_cluster() as _:
        spec = ClusterSpec(model=str(tiny_path), namespace=f"pd-{prefill}", engine_options={"num_threads": 1},
                           role_engine_options={"prefill": {"quantization": prefill},
                                                "decode": {"quantization": decode}})
        with router_server(spec) as (url, actors, _):
            yield url, actors, str(tiny_path), request.param


def handed_over(model: str, formats: tuple[str, str], prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a prefill engine's first token and KV (formats[0]), decoded by an engine of formats[1]."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    prefill = Engine(model, quantization=formats[0])
    prefill.add_request("r", prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), export_kv=True)
    (out,) = prefill.step()
    decode = Engine(model, quantization=formats[1])
    decode.add_prefilled("r", prompt, SampledToken(out.new_token_ids[0], out.new_logprobs[0]), params, out.kv)
    tokens = list(out.new_token_ids)
    while decode.has_unfinished_requests:
        for step in decode.step():
            tokens += step.new_token_ids
    return tokens


def test_answers_are_the_handed_over_engines(server):
    url, _, model, formats = server
    tokenizer = Tokenizer.from_folder(model)
    full_precision, num_different = Engine(model), 0
    for prompt in checks.prompts(3, 500)[:3]:
        want = handed_over(model, formats, prompt, 16)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        num_different += want != full_precision.generate([prompt], params)[0].token_ids
        body = checks.completion(url, prompt, 16)
        assert body["choices"][0]["text"] == tokenizer.decode(want)
        text, _ = checks.streamed_text(url, prompt, 16)
        assert text == tokenizer.decode(want)
    assert num_different >= 1  # so the answers above show the quantized workers ran
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    got = client.completions.create(model="test-model", prompt="Once upon a time", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    want = handed_over(model, formats, tokenizer.encode("Once upon a time"), 12)
    assert got.choices[0].text == tokenizer.decode(want)


def test_each_worker_reports_its_format_and_kernels(server):
    actors, (prefill, decode) = server[1], server[3]
    stats = {s.role: s for s in ray.get([a.stats.remote("test") for a in actors])}
    assert stats["prefill"].quantization == prefill and stats["decode"].quantization == decode
    for s in stats.values():
        assert "mode native" in s.kernels and "linear" in s.kernels
    assert decode in stats["decode"].kernels
    only_prefill = PRODUCTS[prefill, decode]
    assert not any(name in stats["decode"].kernels for name in only_prefill)
    assert any(name in stats["prefill"].kernels for name in only_prefill)
