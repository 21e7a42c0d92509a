"""Tests for services.model_config and services.checkpoint: HF folders of every family, and bad folders."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.checkpoint import expected_shapes, load_weights, validate_folder
from services.errors import CheckpointError
from services.model_config import ModelConfig, RopeScaling
from services.model_presets import write_model

try:  # only the tests that compare with transformers need it; the others run without it
    import transformers
except ImportError:
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16384)
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
BASE = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                   rope_scaling=None, max_position_embeddings=16384, tie_word_embeddings=False,
                   attention_bias=False, qk_norm=False, torch_dtype="float32", bos_token_id=None, eos_token_ids=())
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rope_theta=500000.0, rope_scaling=LLAMA3, tie_word_embeddings=True, bos_token_id=1,
                   eos_token_id=[2, 3]),
              dict(rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
                   tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2, 3))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096, bos_token_id=1, eos_token_id=2),
                dict(architecture="mistral", sliding_window=4096, bos_token_id=1, eos_token_ids=(2,))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6, eos_token_id=5),
              dict(architecture="qwen2", attention_bias=True, tie_word_embeddings=True, rope_theta=1e6,
                   eos_token_ids=(5,))),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6, eos_token_id=5),
              dict(architecture="qwen3", head_dim=32, qk_norm=True, rope_theta=1e6, eos_token_ids=(5,))),
}


@pytest.mark.parametrize("family", FAMILIES)
@needs_transformers
def test_transformers_checkpoints_load_exactly(family, tmp_path):
    config_class, model_class, kwargs, fields = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**SMALL, **kwargs))
    model.save_pretrained(tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    assert config == dataclasses.replace(BASE, **fields)
    weights = load_weights(tmp_path, config, torch.float32)
    state = model.state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    assert set(weights) == set(state) == set(expected_shapes(config))
    assert all(torch.equal(weights[name], state[name]) for name in state)


@needs_transformers
def test_config_saved_alone_falls_back_to_model_type(tmp_path):
    transformers.LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=LLAMA3).save_pretrained(tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    assert (config.architecture, config.rope_theta, config.rope_scaling) == (
        "llama", 500000.0, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192))


def raw_config(**changes) -> dict:
    raw = {"architectures": ["LlamaForCausalLM"], **SMALL, "rms_norm_eps": 1e-6}
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_rope_forms_agree():
    legacy = ModelConfig.from_hf_dict(raw_config(rope_theta=5e5, rope_scaling=LLAMA3))
    nested = ModelConfig.from_hf_dict(raw_config(rope_parameters={**LLAMA3, "rope_theta": 5e5}))
    assert legacy == nested == dataclasses.replace(BASE, rope_theta=5e5, rope_scaling=RopeScaling("llama3", 32.0,
                                                                                                   1.0, 4.0, 8192))
    old_linear = ModelConfig.from_hf_dict(raw_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert old_linear.rope_scaling == RopeScaling("linear", 2.0)
    default = ModelConfig.from_hf_dict(raw_config(rope_parameters={"rope_type": "default", "rope_theta": 7.0}))
    assert (default.rope_theta, default.rope_scaling) == (7.0, None)


def test_defaults():
    raw = raw_config(num_key_value_heads=None, rms_norm_eps=None, max_position_embeddings=None, dtype="bfloat16")
    config = ModelConfig.from_hf_dict(raw)
    assert (config.num_kv_heads, config.head_dim, config.rms_norm_eps, config.max_position_embeddings) == (
        4, 16, 1e-6, 2048)
    assert (config.torch_dtype, config.rope_theta, config.tie_word_embeddings) == ("bfloat16", 10000.0, False)


def test_generation_config_eos_wins(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw_config(bos_token_id=1, eos_token_id=2)))
    assert ModelConfig.from_folder(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8, 7]}))
    assert (ModelConfig.from_folder(tmp_path).bos_token_id, ModelConfig.from_folder(tmp_path).eos_token_ids) == (
        1, (7, 8))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 400}))
    with pytest.raises(CheckpointError, match=r"generation_config.json: field 'eos_token_id' holds 400"):
        ModelConfig.from_folder(tmp_path)


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "'architectures' names 'GPT2LMHeadModel', which is not supported; "
     "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'rope_scaling.rope_type' is 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'rope_parameters.rope_type' is 'dynamic'"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": None}}, "rope_scaling: required field 'low_freq_factor'"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' is 'gelu'; only 'silu'"),
    ({"num_key_value_heads": 3}, "'num_attention_heads' \\(4\\) is not divisible by 'num_key_value_heads' \\(3\\)"),
    ({"hidden_size": 0}, "field 'hidden_size' must be a positive integer, got 0"),
    ({"num_hidden_layers": True}, "field 'num_hidden_layers' must be a positive integer, got True"),
    ({"vocab_size": None}, "required field 'vocab_size' is missing"),
    ({"torch_dtype": "float64"}, "field 'torch_dtype' is 'float64'"),
    ({"attention_bias": True}, "field 'attention_bias' is true for llama"),
    ({"mlp_bias": True}, "field 'mlp_bias' is true"),
    ({"eos_token_id": 300}, "field 'eos_token_id' holds 300, not a token id below 300"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "field 'use_sliding_window' is true"),
])
def test_bad_config_names_file_and_field(changes, message):
    with pytest.raises(CheckpointError, match="^some/config.json: .*" + message):
        ModelConfig.from_hf_dict(raw_config(**changes), source="some/config.json")


def test_missing_and_invalid_config_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json: file not found"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": [')
    with pytest.raises(CheckpointError, match=r"config.json: invalid JSON"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw_config()))
    (tmp_path / "generation_config.json").write_text("not json")
    with pytest.raises(CheckpointError, match=r"generation_config.json: invalid JSON"):
        ModelConfig.from_folder(tmp_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture
def folder(tiny, tmp_path):
    """A private copy of the tiny model that a test may break."""
    return shutil.copytree(tiny, tmp_path / "model")


def test_validate_folder(folder, tmp_path):
    assert validate_folder(folder) == folder
    with pytest.raises(CheckpointError, match="model folder not found"):
        validate_folder(tmp_path / "nowhere")
    (folder / "tokenizer.json").unlink()
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing tokenizer.json, \*.safetensors weights"):
        validate_folder(folder)


def test_load_converts_dtype_and_ignores_extras(folder):
    config = ModelConfig.from_folder(folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, folder / "model.safetensors")
    loaded = load_weights(folder, config, torch.bfloat16)
    assert list(loaded) == list(expected_shapes(config))
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    tied = dataclasses.replace(config, tie_word_embeddings=True)  # lm_head present but unused
    assert "lm_head.weight" not in load_weights(folder, tied, torch.float32)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/self/maps here")
def test_loaded_weights_leave_no_file_mapped(tiny):
    """The tensors are copies, in the file's own dtype too: none keeps the safetensors file mapped (a view of it
    kept the whole mapping resident in the worker)."""
    config = ModelConfig.from_folder(tiny)
    loaded = load_weights(tiny, config, torch.float32)  # the file's dtype: a view would do, a copy is made
    file = str((tiny / "model.safetensors").resolve())
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(file)]
    assert mapped == [] and len(loaded) == len(expected_shapes(config))
    assert torch.equal(loaded["lm_head.weight"], load_file(tiny / "model.safetensors")["lm_head.weight"])


@needs_transformers
def test_sharded_round_trip(tiny, tmp_path):
    sharded = write_model("tiny", tmp_path / "sharded", seed=0, max_shard_bytes=700_000)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == 4 * 311_872
    config = ModelConfig.from_folder(tiny)
    single, split = load_weights(tiny, config, torch.float32), load_weights(sharded, config, torch.float32)
    assert list(single) == list(split)
    assert all(torch.equal(single[name], split[name]) for name in single)
    model = transformers.LlamaForCausalLM.from_pretrained(sharded)
    assert torch.equal(model.state_dict()["lm_head.weight"], single["lm_head.weight"])


def test_missing_tensor(folder):
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(expected "
                       r"shape \[256, 64\]\) in .*model.safetensors"):
        load_weights(folder, ModelConfig.from_folder(folder), torch.float32)


def test_wrong_shape(folder):
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.k_proj.weight' in .*model."
                       r"safetensors has shape \[64, 64\], expected \[32, 64\]"):
        load_weights(folder, ModelConfig.from_folder(folder), torch.float32)


def test_truncated_file(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: cannot open safetensors file, truncated"):
        load_weights(folder, ModelConfig.from_folder(folder), torch.float32)


def test_index_errors(tmp_path):
    sharded = write_model("tiny", tmp_path / "sharded", seed=0, max_shard_bytes=700_000)
    config = ModelConfig.from_folder(sharded)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    moved = {**index["weight_map"], "model.norm.weight": "model-00001-of-00002.safetensors"}
    index_path.write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.norm.weight' .* in .*model-00001-of-00002."
                       r"safetensors, where model.safetensors.index.json places it"):
        load_weights(sharded, config, torch.float32)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"index.json: names shard 'model-00002-of-00002.safetensors', "
                       "which does not exist"):
        load_weights(sharded, config, torch.float32)
    index_path.write_text("{")
    with pytest.raises(CheckpointError, match=r"index.json: invalid JSON"):
        load_weights(sharded, config, torch.float32)
