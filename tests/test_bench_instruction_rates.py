"""The instruction-rate probe's prefill and decode-step floors count what the engine's roofline counts."""

from __future__ import annotations

from benchmarks.instruction_rates import decode_step_macs, prefill_macs
from services import Engine


def test_prefill_macs_are_the_engines_prefill_flops_halved(tiny_path):
    cost = Engine(model=str(tiny_path)).runner.cost
    assert prefill_macs("tiny", 100) * 2 == cost.prefill_flops([100], [100], 1)


def test_decode_step_macs_are_the_engines_flops_of_that_step_halved(tiny_path):
    cost = Engine(model=str(tiny_path)).runner.cost
    assert decode_step_macs("tiny", 3, 50) * 2 == cost.prefill_flops([1, 1, 1], [50, 50, 50], 3)
