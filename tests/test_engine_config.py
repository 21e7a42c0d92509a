"""EngineConfig: validation and resolution of dtype, context length and pool size."""

from __future__ import annotations

import pytest

from services.engine_config import EngineConfig
from services.model_presets import PRESETS


def test_auto_dtype_resolution():
    bf16_model = PRESETS["1b"].model_config()
    fp32_model = PRESETS["tiny"].model_config()
    auto = EngineConfig(model="x")
    assert auto.resolve_dtype(bf16_model, "cpu", cpu_has_bf16=True) == "bfloat16"
    assert auto.resolve_dtype(bf16_model, "cpu", cpu_has_bf16=False) == "float32"
    assert auto.resolve_dtype(fp32_model, "cpu", cpu_has_bf16=True) == "float32"
    assert auto.resolve_dtype(bf16_model, "cuda") == "bfloat16"
    assert EngineConfig(model="x", dtype="float16").resolve_dtype(bf16_model, "cpu") == "float16"


def test_bad_settings_are_refused_and_sizes_resolve():
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model="x", dtype="int8")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least max_num_seqs"):
        EngineConfig(model="x", max_num_seqs=64, max_num_batched_tokens=32)
    tiny = PRESETS["tiny"].model_config()
    assert EngineConfig(model="x").resolve_max_model_len(tiny) == tiny.max_position_embeddings
    with pytest.raises(ValueError, match="max_model_len must be in"):
        EngineConfig(model="x", max_model_len=10**6).resolve_max_model_len(tiny)
    # K and V x 4 layers x 2 kv heads x 16 dims x 4 bytes x 16 tokens = 16 KiB a block;
    # by need: 64 seqs x 2048 / 16 blocks; by memory: 1 MiB / 16 KiB = 64 blocks
    assert EngineConfig(model="x").resolve_num_kv_blocks(tiny, 4, 2048) == 64 * 128
    assert EngineConfig(model="x", kv_cache_memory_gb=2**-10).resolve_num_kv_blocks(tiny, 4, 2048) == 64


def test_quantization_and_kernels_are_validated_and_kernels_default_from_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, w8a8, w4a8 or None, got 'int3'"):
        EngineConfig(model="x", quantization="int3")
    with pytest.raises(ValueError, match="kernels must be one of auto, torch, native, got 'fast'"):
        EngineConfig(model="x", kernels="fast")
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    assert EngineConfig(model="x").kernels == "torch"
    monkeypatch.delenv("PDSERVE_KERNELS")
    assert EngineConfig(model="x").kernels == "auto"
    monkeypatch.setenv("PDSERVE_KERNELS", "fastest")
    with pytest.raises(ValueError, match="kernels must be one of"):
        EngineConfig(model="x")
