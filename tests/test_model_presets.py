"""Tests for services.model_presets: deterministic synthetic checkpoints that transformers loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from services import model_presets
from services.checkpoint import load_weights
from services.model_config import ModelConfig
from services.model_presets import (
    PRESETS,
    build_tokenizer,
    default_model_dir,
    ensure_default_model,
    write_model,
)

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model("tiny", tmp_path_factory.mktemp("presets") / "tiny", seed=0)


def test_tiny_folder_has_every_file_and_no_leftovers(tiny):
    assert sorted(p.name for p in tiny.iterdir()) == FILES
    assert [p.name for p in tiny.parent.iterdir()] == ["tiny"]  # no temp or old folders beside it


def test_same_seed_gives_identical_bytes(tiny, tmp_path):
    again = write_model("tiny", tmp_path / "again", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name


def test_different_seed_gives_different_weights_and_same_tokenizer(tiny, tmp_path):
    other = write_model("tiny", tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_written_config_matches_the_preset(tiny):
    config = ModelConfig.from_folder(tiny)
    assert config == PRESETS["tiny"].model_config()
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (
        512, 64, 4, 4, 2)
    assert (config.bos_token_id, config.eos_token_ids, config.torch_dtype) == (0, (1, 3), "float32")
    assert json.loads((tiny / "config.json").read_text())["eos_token_id"] == 1  # generation_config wins


def test_transformers_loads_the_same_weights(tiny):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(tiny).eval()
    ours = load_weights(tiny, ModelConfig.from_folder(tiny), torch.float32)
    state = model.state_dict()
    assert set(state) == set(ours)
    assert all(torch.equal(state[name], ours[name]) for name in ours)
    with torch.no_grad():
        logits = model(torch.tensor([[0, 400, 289, 15, 293, 282, 342, 4]])).logits  # [1, T, V]
    assert logits.shape == (1, 8, 512)
    # Peaked on purpose: greedy comparisons against other implementations should not hinge on ties.
    assert logits.softmax(-1).max(-1).values.median() > 0.2
    assert int(logits.argmax(-1).max()) < 500  # the zero padding rows never win


def test_padding_rows_are_zero(tiny):
    weights = load_file(tiny / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert weights[name][500:].abs().sum() == 0
        assert weights[name][:500].abs().sum(dim=1).ne(0).all()


def test_transformers_tokenizer_round_trips(tiny):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    assert tokenizer("Hello, world!")["input_ids"] == [0, 400, 289, 15, 293, 282, 342, 4]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    for text in ["Hello, world!", "Café naïve 日本語 🙂 Ελληνικά", "  two  spaces\nand a tab\t.", "x" * 100]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == 0 and max(ids) < 500
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_is_chatml_with_bos(tiny):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<|begin_of_text|>", "<|end_of_text|>", True)


def test_tokenizer_training_is_deterministic_and_reaches_its_size():
    assert build_tokenizer().to_str() == build_tokenizer().to_str()
    assert build_tokenizer().get_vocab_size() == 500
    assert build_tokenizer(32000).get_vocab_size() == 32000  # the small preset's


def test_dtype_option_casts_the_same_draw(tiny, tmp_path):
    bf16 = write_model("tiny", tmp_path / "bf16", seed=0, dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    low, full = load_file(bf16 / "model.safetensors"), load_file(tiny / "model.safetensors")
    assert all(low[name].dtype == torch.bfloat16 for name in low)
    assert all(torch.equal(low[name], full[name].to(torch.bfloat16)) for name in full)


def test_preset_parameter_counts():
    assert PRESETS["tiny"].model_config().num_params == 311_872
    small, one_b = PRESETS["small"].model_config(), PRESETS["1b"].model_config()
    assert small.num_params == 124_668_672
    assert one_b.num_params == 1_107_363_840
    assert 100e6 <= small.num_params <= 150e6
    assert 1.0e9 <= one_b.num_params <= 1.25e9
    assert one_b.tie_word_embeddings and one_b.rope_scaling.rope_type == "llama3"
    assert all(p.tokenizer_vocab_size <= p.vocab_size for p in PRESETS.values())


def test_one_b_preset_would_shard_in_two():
    preset = PRESETS["1b"]
    total_bytes = 2 * preset.model_config().num_params  # bfloat16
    assert preset.max_shard_bytes < total_bytes <= 2 * preset.max_shard_bytes


def test_overwrite_replaces_the_folder(tmp_path):
    out = write_model("tiny", tmp_path / "m", seed=1)
    (out / "stale.txt").write_text("from an older write")
    write_model("tiny", out, seed=0)
    assert sorted(p.name for p in out.iterdir()) == FILES
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_presets, "_write_weights", fail)
    with pytest.raises(KeyboardInterrupt):
        write_model("tiny", tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'huge'; known: tiny, small, 1b"):
        write_model("huge", tmp_path / "m")
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        write_model("tiny", tmp_path / "m", dtype="float64")
    assert list(tmp_path.iterdir()) == []


def test_default_model_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache" / "models" / "tiny-seed0"
    monkeypatch.delenv("PDSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home" / ".cache" / "pdserve" / "models" / "tiny-seed0"


def test_ensure_default_model_writes_once(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / "models" / "tiny-seed0"
    assert (path / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    monkeypatch.setattr(model_presets, "_write_to_temp", lambda *a, **k: pytest.fail("rewrote the model"))
    assert ensure_default_model() == path
