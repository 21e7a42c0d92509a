"""Checks a Hugging Face model folder and loads its safetensors weights by their HF names."""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from services.errors import CheckpointError
from services.gguf_folder import resolve_folder
from services.kernels.onednn_packs import fits
from services.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the runtime needs, by HF name, with its shape (lm_head only when untied)."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, d)
        shapes[p + "mlp.up_proj.weight"] = (inter, d)
        shapes[p + "mlp.down_proj.weight"] = (d, inter)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def validate_folder(path: str | Path) -> Path:
    """Check that `path` is a folder with config.json, tokenizer.json and safetensors weights (a `.gguf`
    file: its converted folder)."""
    folder = resolve_folder(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder not found")
    missing = [name for name in ("config.json", "tokenizer.json") if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append(f"*.safetensors weights ({SINGLE_FILE} or shards with {INDEX_FILE})")
    if missing:
        raise CheckpointError(f"{folder}: missing {', '.join(missing)}")
    return folder


def load_weights(folder: str | Path, config: ModelConfig, dtype: torch.dtype,
                 quantizing: bool = False) -> dict[str, torch.Tensor]:
    """Load every expected tensor as `dtype`, checking all names and shapes before reading any data.

    Reads `model.safetensors.index.json` and its shards when present, else every `*.safetensors`
    file in the folder. Tensors the runtime does not use (`rotary_emb.inv_freq`, a tied lm_head) are ignored.
    A `.gguf` file's converted folder is read in its place. With `quantizing`, the projections a quantization
    rounds (`PROJECTIONS`) that the file stores in float32 stay float32 where memory holds them: rounded once, from
    the file's own values (a Q4_0 or Q4_1 GGUF's exactly: services/int4_weight.py), not after a cast to `dtype`.
    """
    folder = resolve_folder(folder)
    expected = expected_shapes(config)
    files, weight_map = _weight_files(folder)
    with ExitStack() as stack:
        handles = {path: _open(path, stack) for path in files}
        names_in = {path: set(handle.keys()) for path, handle in handles.items()}
        if weight_map is None:
            located = _locate(handles)
        else:
            located = {name: folder / file for name, file in weight_map.items()}
        for name, shape in expected.items():
            path = located.get(name)
            if path is None:
                where = ", ".join(str(p) for p in handles)
                raise CheckpointError(f"missing tensor {name!r} (expected shape {list(shape)}) in {where}")
            if name not in names_in[path]:
                raise CheckpointError(f"missing tensor {name!r} (expected shape {list(shape)}) in {path}, "
                                      f"where {INDEX_FILE} places it")
            found = tuple(handles[path].get_slice(name).get_shape())
            if found != shape:
                raise CheckpointError(f"tensor {name!r} in {path} has shape {list(found)}, expected {list(shape)}")
        exact = _float32_projections(handles, located, expected, dtype) if quantizing else set()
        # copies, even in the file's own dtype: safetensors' tensors are views of the file's mapping, and one kept
        # (a norm's 4 KB) kept all of it mapped — the `1b` preset's 2.1 GB counted in the worker's resident size
        return {name: _read(handles[located[name]], name, located[name]).to(
            torch.float32 if name in exact else dtype, copy=True) for name in expected}


PROJECTIONS = ("_proj.weight", "lm_head.weight")  # the names' endings of the matrices a quantization rounds


def _float32_projections(handles: dict[Path, Any], located: dict[str, Path], expected: dict[str, tuple[int, ...]],
                         dtype: torch.dtype) -> set[str]:
    """The projections stored in float32, if memory holds them so until they are quantized (else none)."""
    found = {name for name in expected if name.endswith(PROJECTIONS)
             and handles[located[name]].get_slice(name).get_dtype() == "F32"}
    extra = sum(math.prod(expected[name]) for name in found) * (4 - dtype.itemsize)
    return found if extra == 0 or fits(extra) else set()


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files to open and the index's weight map; without an index, every `*.safetensors` file."""
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
        return files, None
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index_path}: invalid JSON ({exc})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: field 'weight_map' must map tensor names to file names")
    files = sorted({folder / name for name in weight_map.values()})
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{index_path}: names shard {path.name!r}, which does not exist at {path}")
    return files, weight_map


def _locate(handles: dict[Path, Any]) -> dict[str, Path]:
    """Tensor name -> the file holding it, refusing a name found in two files."""
    located: dict[str, Path] = {}
    for path, handle in handles.items():
        for name in handle.keys():
            if name in located:
                raise CheckpointError(f"tensor {name!r} appears in both {located[name]} and {path}")
            located[name] = path
    return located


def _open(path: Path, stack: ExitStack) -> Any:
    try:
        return stack.enter_context(safe_open(str(path), framework="pt"))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: cannot open safetensors file, truncated or corrupt? ({exc})") from exc


def _read(handle: Any, name: str, path: Path) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"tensor {name!r} in {path}: cannot read ({exc})") from exc
