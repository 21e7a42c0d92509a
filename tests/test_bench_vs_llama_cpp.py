"""The llama.cpp comparison pairs each pdserve mode with llama.cpp's GGUF of the same bits, round by round."""

from __future__ import annotations

from benchmarks.vs_llama_cpp import ROUNDS_ROOM_BYTES, memory_warning, same_bits_pairs


def test_same_bits_pairs_compare_round_by_round():
    samples = {"pdserve bfloat16": {"decode_ms": [50.0, 60.0, 80.0]}, "llama.cpp f16": {"decode_ms": [55.0, 48.0, 88.0]},
               "pdserve w4a8": {"decode_ms": [30.0, 40.0]}, "llama.cpp q4_0": {"decode_ms": [24.0, 50.0]},
               "pdserve int8": {"decode_ms": [40.0]}}  # no Q8_0 run: no pair
    pairs = same_bits_pairs(samples)
    assert pairs == {
        "pdserve bfloat16 vs llama.cpp f16": {"ratios": [1.1, 0.8, 1.1], "median": 1.1, "pdserve_faster": 2},
        "pdserve w4a8 vs llama.cpp q4_0": {"ratios": [0.8, 1.25], "median": 1.025, "pdserve_faster": 1}}


def test_a_host_short_of_memory_for_the_rounds_is_told_before_them():
    assert memory_warning(None) is None and memory_warning(ROUNDS_ROOM_BYTES) is None
    said = memory_warning(3 << 30)
    assert said.startswith("warning: 3.0 GiB of memory left") and "about 6:" in said and "run fewer systems" in said
