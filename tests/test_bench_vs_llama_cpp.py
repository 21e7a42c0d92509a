"""The llama.cpp comparison pairs each pdserve mode with llama.cpp's GGUF of the same bits, round by round."""

from __future__ import annotations

import pytest

from benchmarks.llama_gguf import gguf_file, write_gguf
from benchmarks.vs_llama_cpp import ROUNDS_ROOM_BYTES, memory_warning, same_bits_pairs


def test_same_bits_pairs_compare_round_by_round():
    samples = {"pdserve bfloat16": {"decode_ms": [50.0, 60.0, 80.0]}, "llama.cpp f16": {"decode_ms": [55.0, 48.0, 88.0]},
               "pdserve w4a8": {"decode_ms": [30.0, 40.0]}, "llama.cpp q4_0": {"decode_ms": [24.0, 50.0]},
               "pdserve int8": {"decode_ms": [40.0]}}  # no Q8_0 run: no pair
    pairs = same_bits_pairs(samples)
    assert pairs == {
        "pdserve bfloat16 vs llama.cpp f16": {"ratios": [1.1, 0.8, 1.1], "median": 1.1, "pdserve_faster": 2},
        "pdserve w4a8 vs llama.cpp q4_0": {"ratios": [0.8, 1.25], "median": 1.025, "pdserve_faster": 1}}


def test_pdserve_serving_a_gguf_pairs_with_llama_cpp_on_that_file():
    samples = {"pdserve int4 on q4_k_m": {"decode_ms": [20.0, 40.0]}, "llama.cpp q4_k_m": {"decode_ms": [25.0, 30.0]},
               "pdserve int8 on q8_0": {"decode_ms": [10.0]}, "llama.cpp q4_0": {"decode_ms": [5.0]}}
    assert same_bits_pairs(samples) == {
        "pdserve int4 on q4_k_m vs llama.cpp q4_k_m": {"ratios": [1.25, 0.75], "median": 1.0, "pdserve_faster": 1}}


def test_a_host_short_of_memory_for_the_rounds_is_told_before_them():
    assert memory_warning(None) is None and memory_warning(ROUNDS_ROOM_BYTES) is None
    said = memory_warning(3 << 30)
    assert said.startswith("warning: 3.0 GiB of memory left") and "about 6:" in said and "run fewer systems" in said


def test_both_q4_0_files_pair_with_the_int4_modes():
    samples = {"pdserve int4": {"decode_ms": [20.0, 40.0]}, "llama.cpp q4_0": {"decode_ms": [25.0, 30.0]},
               "llama.cpp q4_0-pure": {"decode_ms": [30.0, 50.0]}}
    assert same_bits_pairs(samples) == {
        "pdserve int4 vs llama.cpp q4_0": {"ratios": [1.25, 0.75], "median": 1.0, "pdserve_faster": 1},
        "pdserve int4 vs llama.cpp q4_0-pure": {"ratios": [1.5, 1.25], "median": 1.375, "pdserve_faster": 2}}


def test_gguf_files_are_named_by_type_and_hold_its_matrices(tiny_path, tmp_path):
    """The gguf package writes f16, q8_0 and q4_0-pure (every matrix Q4_0); `q4_0` and `q4_k_m` are llama.cpp's
    quantizer's (needs llama-cpp-python, the `bench` extra: not tested here); an unknown type is refused by name."""
    gguf = pytest.importorskip("gguf")
    expected = {"f16": "F16", "q8_0": "Q8_0", "q4_0-pure": "Q4_0"}
    for qtype, matrix_type in expected.items():
        path = gguf_file(tiny_path, tmp_path, qtype)
        assert path == tmp_path / f"{tiny_path.name}-{qtype}.gguf"
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
        assert types["blk.0.ffn_down.weight"] == types["output.weight"] == matrix_type
        assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
        assert gguf_file(tiny_path, tmp_path, qtype) == path  # written once
    with pytest.raises(ValueError, match="qtype must be one of f16, q8_0, q4_0, q4_0-pure, q4_k_m, got 'q5_0'"):
        gguf_file(tiny_path, tmp_path, "q5_0")
    for made_by_llama_cpp in ("q4_0", "q4_k_m"):
        with pytest.raises(ValueError, match=f"write_gguf writes f16, q8_0, q4_0-pure, got '{made_by_llama_cpp}'"):
            write_gguf(tiny_path, tmp_path / "x.gguf", made_by_llama_cpp)
