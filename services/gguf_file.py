"""A llama.cpp GGUF file read with the `gguf` package: its metadata as a Hugging Face config, its
tensors dequantized under Hugging Face names (imports no torch)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import CheckpointError

# general.architecture -> the HF class whose layout the tensors take. llama.cpp writes Llama and
# Mistral checkpoints as "llama" (and permutes their q/k rows, see `_unpermute`); Qwen2/Qwen3 keep HF's rows.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_PERMUTED_QK = ("llama",)

# general.file_type -> the dtype config.json records (the serving default): 0 F32, 1 F16, 32 BF16; every
# quantized type was made from a 16-bit checkpoint, so it serves as bfloat16 where the CPU has it.
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

# llama.cpp tensor names -> HF names ({} is the layer index)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be served: unreadable, truncated, or describing what pdserve does not run."""


class GGUFFile:
    """One GGUF file, parsed once (tensor data stays memory-mapped until dequantized)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: GGUF file not found")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{self.path}: not a GGUF file (starts with {magic!r}, not b'GGUF')")
        try:
            self._reader = gguf.GGUFReader(self.path)
        except ValueError as exc:
            found = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
            if found:
                raise GGUFError(f"{self.path}: a tensor has type {found.group(1)}, which the gguf package does not "
                                "know (a newer llama.cpp type?)") from exc
            raise GGUFError(f"{self.path}: cannot read the GGUF file, truncated or corrupt? ({exc})") from exc
        except (IndexError, OSError) as exc:
            raise GGUFError(f"{self.path}: cannot read the GGUF file, truncated or corrupt? ({exc})") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.architecture = self.value("general.architecture", str)
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: general.architecture is {self.architecture!r}, which pdserve does not run; "
                            f"supported: {', '.join(ARCHITECTURES)}")

    def value(self, key: str, kind: type, default: Any = ...) -> Any:
        """The metadata value at `key`, checked to be of `kind` (int, float, str, bool or list)."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path}: metadata {key!r} is missing")
            return default
        value = field.contents()
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        elif kind is float and ok and field.types == [_value_type("FLOAT32")]:
            # the shortest decimal of the float32: 1e-05 as config.json wrote it, not 9.999999747378752e-06
            value = float(str(np.float32(value)))
        if not ok:
            raise GGUFError(f"{self.path}: metadata {key!r} is {str(value)[:80]!r}, expected {kind.__name__}")
        return value

    def _arch_int(self, key: str, default: Any = ...) -> int:
        value = self.value(f"{self.architecture}.{key}", int, default)
        if value is not None and value <= 0:
            raise GGUFError(f"{self.path}: metadata '{self.architecture}.{key}' must be positive, got {value}")
        return value

    def hf_config(self) -> dict:
        """config.json for these weights, from `{arch}.*` and `tokenizer.ggml.*` metadata."""
        a = self.architecture
        hidden, heads = self._arch_int("embedding_length"), self._arch_int("attention.head_count")
        kv_heads = self._arch_int("attention.head_count_kv", heads)
        head_dim = self._arch_int("attention.key_length", hidden // heads)
        rotary = self._arch_int("rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise GGUFError(f"{self.path}: '{a}.rope.dimension_count' is {rotary}, head size {head_dim}; "
                            "partial rotary embeddings are not supported")
        if "rope_freqs.weight" in self._tensors:
            raise GGUFError(f"{self.path}: tensor 'rope_freqs.weight' (Llama 3.1 rope scaling as llama.cpp stores it) "
                            "is not supported")
        tokens = self.value("tokenizer.ggml.tokens", list, None)
        vocab = self._arch_int("vocab_size", len(tokens) if tokens else None)
        if vocab is None:
            vocab = self._tensor("token_embd.weight").shape[-1].item()
        bos = self.value("tokenizer.ggml.bos_token_id", int, None)
        eos = [self.value(f"tokenizer.ggml.{k}_token_id", int, None) for k in ("eos", "eot")]
        return {
            "architectures": [ARCHITECTURES[a]], "model_type": a,
            "vocab_size": vocab, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": self._arch_int("feed_forward_length"),
            "num_hidden_layers": self._arch_int("block_count"),
            "max_position_embeddings": self._arch_int("context_length", 2048),
            "rms_norm_eps": self.value(f"{a}.attention.layer_norm_rms_epsilon", float),
            "rope_theta": self.value(f"{a}.rope.freq_base", float, 10000.0), "rope_scaling": self._rope_scaling(),
            "tie_word_embeddings": "output.weight" not in self._tensors, "hidden_act": "silu",
            "torch_dtype": _FILE_DTYPES.get(self.value("general.file_type", int, 0), "bfloat16"),
            "bos_token_id": bos, "eos_token_id": [i for i in dict.fromkeys(eos) if i is not None] or None,
        }

    def _rope_scaling(self) -> dict | None:
        kind = self.value(f"{self.architecture}.rope.scaling.type", str, "none")
        if kind == "none":
            return None
        if kind != "linear":
            raise GGUFError(f"{self.path}: '{self.architecture}.rope.scaling.type' is {kind!r}; supported: none, linear")
        return {"rope_type": "linear", "factor": self.value(f"{self.architecture}.rope.scaling.factor", float)}

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    def hf_tensors(self, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array) for every tensor: float32, or float16 where the file holds F16 (exactly the
        file's values either way); q/k rows put back in HF's half-split rotary order."""
        for name in self._tensors:
            hf_name = self.hf_name(name)
            array = self._dequantized(name)
            if self.architecture in _PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                array = _unpermute(array, num_heads if "q_proj" in hf_name else num_kv_heads)
            yield hf_name, array

    def hf_name(self, name: str) -> str:
        if name in _TOP_NAMES:
            return _TOP_NAMES[name]
        layer = _LAYER.fullmatch(name)
        if layer is None or layer.group(2) not in _LAYER_NAMES:
            raise GGUFError(f"{self.path}: tensor {name!r} has no place in a {self.architecture} model")
        return f"model.layers.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}"

    def _tensor(self, name: str) -> Any:
        if name not in self._tensors:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        return self._tensors[name]

    def _dequantized(self, name: str) -> np.ndarray:
        import gguf.quants

        tensor = self._tensors[name]
        kind = tensor.tensor_type
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest-varying axis first
        try:
            if kind == gguf.GGMLQuantizationType.F16:
                return np.asarray(tensor.data, dtype=np.float16).reshape(shape)
            return gguf.quants.dequantize(tensor.data, kind).astype(np.float32, copy=False).reshape(shape)
        except NotImplementedError as exc:
            raise GGUFError(f"{self.path}: tensor {name!r} has type {kind.name}, which the gguf package cannot "
                            "dequantize") from exc


def _value_type(name: str) -> object:
    import gguf

    return gguf.GGUFValueType[name]


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaved rotary rows (convert_hf_to_gguf.py `LlamaModel.permute`) -> HF's half-split order."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
