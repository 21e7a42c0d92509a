"""llama.cpp's 4-bit blocks kept as the file holds them: a group already on a Q4_0 grid ((q - 8) d, d float16) keeps
that grid under `--quantization int4` (scale d, negative where the block's largest value is positive; low -8 d),
every int4 and w4a8 kernel multiplies such negative scales right, and a Q4_0 GGUF served with int4 decodes from its
own weights: the loader keeps a float32 file's projections in float32 until they are quantized."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_writer import write_gguf
from real_text import default_model_folder, follows_float32
from test_gguf_file import cache, folder  # noqa: F401 (fixtures: the tiny preset, a cache folder of this module's)

from services import Engine
from services.checkpoint import load_weights
from services.int4_weight import Int4Weight
from services.kernels.linear_candidates import candidates
from services.kernels.native import load
from services.model_config import ModelConfig
from services.quantized_weight import quantize

Q4_0, Q4_1 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1


def q4_0_blocks(weight: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_0 of `weight` [N, K]: its values (float32), each block's d [N, K / 32] and q [N, K] (0..15),
    read from the bytes (a block: float16 d, then 16 bytes, q of column j in byte j's low nibble, j + 16 in its
    high one)."""
    raw = gguf.quants.quantize(weight, Q4_0)
    n, k = weight.shape
    blocks = torch.from_numpy(raw.reshape(n, k // 32, 18).copy())
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
    nibbles = blocks[..., 2:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(n, k)
    return torch.from_numpy(gguf.quants.dequantize(raw, Q4_0)).float(), d, q


def test_a_q4_0_block_keeps_its_own_d_and_levels():
    g = np.random.default_rng(0)
    values, d, q = q4_0_blocks((g.standard_normal((48, 192)) * 0.05).astype(np.float32))
    weight = Int4Weight.quantize(values)
    assert torch.equal(weight.scale, d) and torch.equal(weight.low, -8 * d)  # -8 d is exact in float16
    assert torch.equal(weight.levels(), q) and torch.equal(weight.dequantize(torch.float32), values)
    assert 0.3 < (weight.scale < 0).float().mean() < 0.7  # the largest magnitude positive: a negative d
    # Q4_1 (q d + m): the min/max grid is the block's own
    q4_1 = gguf.quants.quantize((g.standard_normal((48, 192)) * 0.05).astype(np.float32), Q4_1)
    exact = torch.from_numpy(gguf.quants.dequantize(q4_1, Q4_1)).float()
    assert torch.equal(Int4Weight.quantize(exact).dequantize(torch.float32), exact)
    # weights on no grid: the min/max grid, positive steps; bf16 weights are never read as blocks
    other = Int4Weight.quantize(torch.from_numpy(g.standard_normal((48, 192)).astype(np.float32)))
    assert bool((other.scale > 0).all())
    assert bool((Int4Weight.quantize(values.bfloat16()).scale > 0).all())


@pytest.mark.parametrize("rows", [1, 5, 40, 70])
def test_every_int4_and_w4a8_kernel_multiplies_a_q4_0_weight(rows):
    g = np.random.default_rng(rows)
    values, _, _ = q4_0_blocks((g.standard_normal((40, 192)) * 0.05).astype(np.float32))
    x = torch.from_numpy(g.standard_normal((rows, 192)).astype(np.float32)).bfloat16()
    bias = torch.from_numpy(g.standard_normal(40).astype(np.float32)).bfloat16()
    max_rows = {1: 1, 5: 8, 40: 64, 70: 1 << 62}[rows]
    for mode in ("int4", "w4a8"):
        weight = quantize(values, mode)
        assert bool((weight.scale < 0).any()), mode
        want = F.linear(x.float(), weight.dequantize(torch.float32), bias.float())
        found = candidates(mode, True, 192, max_rows, load(), True, torch.bfloat16)
        assert len(found) >= 2 if mode == "int4" else len(found) == 1
        for name, fn in found.items():
            got = fn(x, weight, bias).float()
            # bf16 rounding of y; w4a8 also rounds x to int8 per group
            assert (got - want).abs().max() <= (0.02 if mode == "int4" else 0.05) * want.abs().max(), (mode, name)


def test_a_q4_0_gguf_served_with_int4_decodes_from_the_files_own_weights(folder, cache, tmp_path):  # noqa: F811
    path = write_gguf(folder, tmp_path / "tiny-q4_0.gguf", matrix_type=Q4_0)
    config = ModelConfig.from_folder(path)
    exact = load_weights(path, config, torch.float32)  # the converted folder: the blocks' values, in float32
    loaded = load_weights(path, config, torch.bfloat16, quantizing=True)
    assert loaded["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32  # projections as the file has them
    assert loaded["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    assert load_weights(path, config, torch.bfloat16)["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    engine = Engine(path, dtype="bfloat16", quantization="int4", kernels="torch", max_model_len=64,
                    kv_cache_memory_gb=0.01)
    model = engine.runner.model
    assert engine.dtype == torch.bfloat16 and model.layers[0].input_norm.dtype == torch.bfloat16
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for weight, names in ((layer.qkv, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              (layer.o, ("self_attn.o_proj",)), (layer.gate_up, ("mlp.gate_proj", "mlp.up_proj")),
                              (layer.down, ("mlp.down_proj",))):
            want = torch.cat([exact[p + n + ".weight"] for n in names])
            assert torch.equal(weight.dequantize(torch.float32), want), (i, names)


def test_float32_projections_only_where_memory_holds_them(folder, monkeypatch):  # noqa: F811
    config = ModelConfig.from_folder(folder)  # the tiny preset is stored in float32
    monkeypatch.setattr("services.checkpoint.fits", lambda extra: False)
    assert load_weights(folder, config, torch.bfloat16, quantizing=True)["lm_head.weight"].dtype == torch.bfloat16
    monkeypatch.setattr("services.checkpoint.fits", lambda extra: True)
    weights = load_weights(folder, config, torch.bfloat16, quantizing=True)
    assert weights["lm_head.weight"].dtype == weights["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float32
    assert weights["model.embed_tokens.weight"].dtype == weights["model.norm.weight"].dtype == torch.bfloat16


def test_a_real_q4_0_model_served_with_int4_is_the_files_model(tmp_path, cache, monkeypatch):  # noqa: F811
    """SmolLM2-135M-Instruct (the default model, fetched once) written as a Q4_0 GGUF (every matrix, the embedding
    too): with `--quantization int4` and bf16 compute it keeps >= 90% of the file's float32 top-1 tokens on real text
    (94.3%, mean |Δ logprob| 0.054; when int4 re-rounded Q4_0's blocks: 67.6%, 0.56)."""
    path = write_gguf(default_model_folder(monkeypatch), tmp_path / "smollm2-q4_0.gguf", matrix_type=Q4_0)
    engine = Engine(path, dtype="bfloat16", quantization="int4", max_model_len=512, num_threads=2, kernels="torch",
                    kv_cache_memory_gb=0.05)
    agree, delta = follows_float32(engine, path)
    assert agree >= 0.9 and delta <= 0.1, (agree, delta)
