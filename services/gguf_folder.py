"""A GGUF file served as a Hugging Face model folder: converted once into the cache folder, keyed by the
file's size, modification time and first MiB, and read by the same loader as every other folder (no torch).

Why a folder rather than a second loader: the engine, the workers, the router's tokenizer and every tool
that takes `--model` read folders; a converted folder serves them all unchanged, is made once per file
(later loads take as long as any folder's), and can be inspected like any checkpoint (docs/models.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from services.cache_folder import cache_root

GGUF_SUFFIX = ".gguf"
_KEY_BYTES = 1 << 20
_MAX_SHARD_BYTES = 2 * 10**9
SOURCE_FILE = "gguf_source.json"  # written into each converted folder: which file it came from


def resolve_folder(path: str | Path) -> Path:
    """`path` itself, unless it names a `.gguf` file: then that file's converted folder (made on first use)."""
    path = Path(path)
    return converted_folder(path) if path.suffix.lower() == GGUF_SUFFIX else path


def converted_folder(gguf_path: str | Path) -> Path:
    """The folder converted from `gguf_path` (cache/gguf/<key>/<file stem>), converting it if it is not there
    yet; safe to race from several processes (each converts into its own temporary folder, one publishes)."""
    from services.gguf_file import GGUFError

    path = Path(gguf_path)
    if not path.is_file():
        raise GGUFError(f"{path}: GGUF file not found")
    out = cache_root() / "gguf" / _key(path) / path.stem
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        _convert(path, tmp)
        os.rename(tmp, out)  # fails if another process published first; its folder is the same
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_KEY_BYTES))
    return digest.hexdigest()[:16]


def _convert(path: Path, out: Path) -> None:
    """Write config, generation config, tokenizer and safetensors weights (dequantized: float32, or float16
    where the file holds F16, so exactly the file's values) for the GGUF at `path` into the folder `out`."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    from services.gguf_file import GGUFFile
    from services.gguf_tokenizer import build_tokenizer
    from services.model_config import ModelConfig

    gguf = GGUFFile(path)
    config = gguf.hf_config()
    shape = ModelConfig.from_hf_dict(config, source=f"{path} (its metadata as config.json)")
    tokenizer, tokenizer_config = build_tokenizer(gguf)
    tokenizer_config["model_max_length"] = shape.max_position_embeddings
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                                 "eos_token_id": config["eos_token_id"]})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    weight_map: dict[str, str] = {}
    shard: dict = {}

    def flush() -> None:  # each shard is written as it fills, so a large model is never whole in memory
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()

    with tqdm(total=gguf.num_tensors, desc=f"pdserve: converting {path.name}", unit=" tensors") as bar:
        for name, array in gguf.hf_tensors(shape.num_heads, shape.num_kv_heads):
            if shard and sum(a.nbytes for a in shard.values()) + array.nbytes > _MAX_SHARD_BYTES:
                flush()
            shard[name] = array
            bar.update()
        flush()
    if len(set(weight_map.values())) == 1:
        os.rename(out / "model-00001.safetensors", out / "model.safetensors")
    else:
        _write_json(out / "model.safetensors.index.json", {"weight_map": weight_map})
    stat = path.stat()
    _write_json(out / SOURCE_FILE, {"gguf": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                    "general.name": gguf.value("general.name", str, None),
                                    "general.file_type": gguf.value("general.file_type", int, None)})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
