"""Tests for services.tokenizer: BOS handling, round trips, chat templates and checkpoint errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from services.errors import CheckpointError
from services.tokenizer import Tokenizer

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "héllo wörld 日本語 🙂 emojis",
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little girl who liked to play outside.",
]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}"
)


def train_bpe(post_processor: bool = False) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style) trained on CORPUS; every byte is in the vocabulary."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS * 4, trainer)
    if post_processor:
        hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return hf


def write_folder(folder: Path, config: dict, post_processor: bool = False) -> Path:
    folder.mkdir(exist_ok=True)
    train_bpe(post_processor).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


BPE_CONFIG = {
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "special": True},
    "eos_token": "</s>",
    "add_bos_token": True,
}


@pytest.fixture
def bpe(tmp_path: Path) -> Tokenizer:
    return Tokenizer.from_folder(write_folder(tmp_path / "bpe", BPE_CONFIG))


def test_special_tokens_and_sizes(bpe: Tokenizer) -> None:
    assert (bpe.bos_token_id, bpe.eos_token_id) == (1, 2)
    assert bpe.all_special_ids == (0, 1, 2, 3, 4)
    assert bpe.vocab_size == 320


@pytest.mark.parametrize("text", [
    "héllo wörld 日本語 🙂 emojis",
    "Ωmega ∑ Ελληνικά — never seen in training",
    "👩‍👩‍👧‍👦 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\t\r\n  trailing  ",
    "",
])
def test_round_trip(bpe: Tokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert ids[0] == 1 and 1 not in ids[1:]
    assert ids[1:] == bpe.encode(text, add_special_tokens=False)
    assert bpe.decode(ids) == text
    assert bpe.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_round_trip_random_unicode(bpe: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(chr(rng.choice([rng.randrange(32, 0x2FF), rng.randrange(0x3000, 0xD7FF),
                                       rng.randrange(0x1F300, 0x1FAFF)])) for _ in range(rng.randrange(1, 30)))
        assert bpe.decode(bpe.encode(text)) == text


def test_special_token_text_is_one_id(bpe: Tokenizer) -> None:
    assert bpe.encode("<|im_start|>", add_special_tokens=False) == [3]
    assert bpe.decode([3, 4]) == ""
    assert bpe.decode([3, 4], skip_special_tokens=False) == "<|im_start|><|im_end|>"


def test_negative_id_is_refused(bpe: Tokenizer) -> None:
    with pytest.raises(ValueError, match="token ids must be >= 0, got -1"):
        bpe.decode([5, -1])


@pytest.mark.parametrize(("add_bos_token", "post_processor", "starts_with_bos"), [
    (True, True, True),  # the post-processor's BOS is not doubled
    (True, False, True),  # prepended by us
    (False, True, False),  # the post-processor's BOS is removed
    (None, True, True),  # absent: the post-processor decides
    (None, False, False),
])
def test_bos_policy(tmp_path: Path, add_bos_token: bool | None, post_processor: bool, starts_with_bos: bool) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    tok = Tokenizer.from_folder(write_folder(tmp_path / "t", config, post_processor))
    body = tok.encode("hello world", add_special_tokens=False)
    assert 1 not in body
    assert tok.encode("hello world") == ([1] if starts_with_bos else []) + body
    chat_body = tok.encode("user: hi\nassistant:", add_special_tokens=False)
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == ([1] if starts_with_bos else []) + chat_body


def test_stories260k_tokenizer() -> None:
    if not STORIES.is_dir():
        pytest.skip("../shared/models/stories260K absent")
    tok = Tokenizer.from_folder(STORIES)
    # Its tokenizer.json post-processor already adds <s> and tokenizer_config.json says add_bos_token.
    assert tok.encode("⟨45⟩ ⟨300⟩") == [1, 45, 300]
    assert tok.encode("⟨45⟩ ⟨300⟩", add_special_tokens=False) == [45, 300]
    assert tok.decode([1, 45, 300]) == "⟨45⟩ ⟨300⟩"
    assert tok.decode([1, 45, 300], skip_special_tokens=False) == "<s> ⟨45⟩ ⟨300⟩"
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size, tok.all_special_ids) == (1, 2, 512, (0, 1, 2))
    assert tok.apply_chat_template([{"role": "user", "content": "⟨7⟩"}]) == "user: ⟨7⟩\nassistant:"
    assert tok.encode_chat([{"role": "user", "content": "⟨7⟩"}]) == [1, 0, 7, 0]  # "user:" is <unk>


def test_chatml_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(write_folder(tmp_path / "t", {**BPE_CONFIG, "chat_template": CHATML}))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == text[: -len("<|im_start|>assistant\n")]
    ids = tok.encode_chat(messages)
    assert ids[:2] == [1, 3] and ids.count(1) == 1 and ids.count(3) == 3 and ids.count(4) == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_template_with_bos_is_not_doubled_and_can_raise(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(write_folder(tmp_path / "t", {**BPE_CONFIG, "chat_template": LLAMA2_STYLE}))
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "more"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s>[INST] hi [/INST] yo</s>[INST] more [/INST]"
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids.count(1) == 1
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    template = (
        "{%- set ns = namespace(n=0) -%}\n"
        "{% for m in messages %}\n"
        "  {%- set ns.n = ns.n + 1 %}\n"
        "  {{ loop.index }}|{{ m.role }}|{{ m | tojson }}\n"
        "  {% if loop.last %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{{ ns.n }}{{ eos_token }}{% if add_generation_prompt %}>{% endif %}"
    )
    folder = write_folder(tmp_path / "t", {**BPE_CONFIG, "chat_template": template})
    messages = [{"role": "user", "content": "<a & 'b'> ü"}, {"role": "assistant", "content": "ok"}]
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                                     eos_token="</s>", chat_template=template)
    ours = Tokenizer.from_folder(folder).apply_chat_template(messages)
    assert ours == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == '  1|user|{"role": "user", "content": "<a & \'b\'> ü"}\n  2|assistant|{"role": "assistant", "content": "ok"}\n2</s>>'


def test_chat_template_file_and_named_list(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}]
    folder = write_folder(tmp_path / "t", {**BPE_CONFIG, "chat_template": named})
    messages = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_folder(folder).apply_chat_template(messages) == "D1"
    (folder / "chat_template.jinja").write_text("F{{ messages[0].content }}", encoding="utf-8")
    assert Tokenizer.from_folder(folder).apply_chat_template(messages) == "Fhi"


def test_plain_fallback(bpe: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert bpe.apply_chat_template(messages) == "system: be brief\nuser: hi\nassistant: hello\ntool: 42\nassistant:"
    assert bpe.apply_chat_template(messages[:2], add_generation_prompt=False) == "system: be brief\nuser: hi\n"
    ids = bpe.encode_chat(messages[:2])
    assert ids == [1] + bpe.encode("system: be brief\nuser: hi\nassistant:", add_special_tokens=False)


@pytest.mark.parametrize(("messages", "error"), [
    ([], "messages must be a non-empty list"),
    ("hi", "messages must be a non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\].role must be one of system, user, assistant, tool"),
    ([{"content": "x"}], r"messages\[0\].role must be one of"),
    ([{"role": "user"}], r"messages\[0\].content must be a string or a list of text parts"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
     r"messages\[1\].content\[0\] must be \{'type': 'text', 'text': <string>\}"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"messages\[0\].content\[0\] must be"),
])
def test_bad_messages(bpe: Tokenizer, messages: list, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        bpe.apply_chat_template(messages)
    with pytest.raises(ValueError, match=error):
        bpe.encode_chat(messages)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: tokenizer\.json is missing"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: tokenizer\.json does not parse"):
        Tokenizer.from_folder(tmp_path)
    folder = write_folder(tmp_path / "t", BPE_CONFIG)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: tokenizer_config\.json is missing"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: tokenizer_config\.json does not parse"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        Tokenizer.from_folder(folder)


@pytest.mark.parametrize(("config", "error"), [
    ({"bos_token": "<bos>"}, r"tokenizer_config\.json: bos_token '<bos>' is not in tokenizer\.json's vocabulary"),
    ({"eos_token": 7}, r"tokenizer_config\.json: eos_token must be a string or a dict"),
    ({"add_bos_token": "yes", "bos_token": "<s>"}, "add_bos_token must be true, false or null"),
    ({"add_bos_token": True}, "add_bos_token is true but there is no bos_token"),
    ({"chat_template": "{% for %}"}, r"tokenizer_config\.json: chat_template does not parse"),
    ({"chat_template": 5}, "chat_template must be a string or a list"),
])
def test_bad_config_values(tmp_path: Path, config: dict, error: str) -> None:
    with pytest.raises(CheckpointError, match=error):
        Tokenizer.from_folder(write_folder(tmp_path / "t", config))


def test_bad_template_file_is_named(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "t", BPE_CONFIG)
    (folder / "chat_template.jinja").write_text("{% if %}", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja: chat_template does not parse"):
        Tokenizer.from_folder(folder)
