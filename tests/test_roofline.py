"""Step costs in the units of the hardware ceilings, checked by hand on the tiny preset, and the
engine's per-phase totals for a real run."""

from __future__ import annotations

from services import Engine, SamplingParams
from services.roofline import ModelCost, PhaseTotals

# tiny: L=4, D=64, H=4, K=2, Dh=16, F=256, V=512, untied, float32
LAYER_PARAMS = 4 * (64 * (4 + 2 + 2) * 16 + 64 * 64 + 2 * 256 * 64 + 64 * 256)
HEAD_PARAMS = 512 * 64
ATTENTION_PER_PAIR = 4 * 4 * 4 * 16  # QK^T and PV, 2 FLOPs each, per head per layer
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 16 * 4


def test_model_cost_of_the_tiny_preset(tiny_path):
    engine = Engine(model=tiny_path)
    cost = engine.runner.cost
    norms = 4 * 2 * 64 + 64  # the RMSNorm weights: read, not multiplied by
    assert (cost.layer_matmul_params, cost.lm_head_params) == (LAYER_PARAMS, HEAD_PARAMS)
    assert cost.weight_bytes == 4 * (LAYER_PARAMS + HEAD_PARAMS + norms)
    assert (cost.attention_flops_per_pair, cost.kv_bytes_per_token) == (ATTENTION_PER_PAIR, KV_BYTES_PER_TOKEN)
    # One prompt of 10 tokens, no cache: 55 (query, key) pairs; one sampled row.
    assert cost.prefill_flops([10], [10], 1) == 2 * LAYER_PARAMS * 10 + 2 * HEAD_PARAMS + ATTENTION_PER_PAIR * 55
    # A 4-token chunk after 6 cached tokens sees 7, 8, 9, 10 keys.
    assert cost.prefill_flops([4], [10], 0) == 2 * LAYER_PARAMS * 4 + ATTENTION_PER_PAIR * 34
    assert cost.decode_bytes([11, 5]) == cost.weight_bytes + KV_BYTES_PER_TOKEN * 16


def test_engine_totals_count_each_step_in_its_phase(tiny_path):
    engine = Engine(model=tiny_path)
    engine.generate([list(range(5, 15)), list(range(20, 26))], SamplingParams(max_tokens=3, temperature=0,
                                                                                ignore_eos=True))
    totals, cost = engine.runner.phase_totals, engine.runner.cost
    # Step 1 prefills both prompts (10 and 6 tokens) and samples both; steps 2-3 decode both.
    assert totals.prefill_flops == cost.prefill_flops([10, 6], [10, 6], 2)
    assert totals.decode_bytes == cost.decode_bytes([11, 7]) + cost.decode_bytes([12, 8])
    assert totals.prefill_seconds > 0 and totals.decode_seconds > 0


def test_a_mixed_step_counts_as_prefill():
    cost = ModelCost(layer_matmul_params=100, lm_head_params=10, weight_bytes=1000, attention_flops_per_pair=8,
                     kv_bytes_per_token=4)
    totals = PhaseTotals()
    totals.record(cost, [1, 3], [9, 3], 2, 0.5)
    assert (totals.prefill_flops, totals.prefill_seconds, totals.decode_bytes) == (
        2 * 100 * 4 + 2 * 10 * 2 + 8 * (9 + 6), 0.5, 0)  # the decoding token sees 9 keys
