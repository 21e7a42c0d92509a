"""The instruction-rate probe's prefill floor counts what the engine's roofline counts."""

from __future__ import annotations

from benchmarks.instruction_rates import prefill_macs
from services import Engine


def test_prefill_macs_are_the_engines_prefill_flops_halved(tiny_path):
    cost = Engine(model=str(tiny_path)).runner.cost
    assert prefill_macs("tiny", 100) * 2 == cost.prefill_flops([100], [100], 1)
