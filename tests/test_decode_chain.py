"""A decode step's layers in one native call (services/kernels/decode_chain.*): the same kernels as the forward's
Python loop, so the same logits bit for bit, whichever kernel the plan chose for each product and whatever the
weights' format; and the models and steps it must leave to the loop."""

from __future__ import annotations

import pytest
import torch
from test_model_vs_transformers import engine_logits

from services import Engine, SamplingParams
from services.kernels.decode_chain import DecodeChains, chain_product
from services.kernels.kernel_plan import BUCKETS, MAX_ROWS, KernelPlan, weight_key
from services.kernels.linear_candidates import candidates

PROMPT = [5, 17, 3, 99, 250, 8, 41, 77, 12, 300, 6, 64, 2, 180]
FORMATS = [("float32", None), ("bfloat16", None), ("float32", "int8"), ("bfloat16", "int8"), ("bfloat16", "int4"),
           ("float32", "int4"), ("bfloat16", "w4a8"), ("float32", "w8a8")]


def plan_choosing(model, pick) -> None:
    """model's plan replaced by one that runs candidate pick(names offered) for every weight and bucket, and its
    chains rebuilt from it."""
    old = model.plan
    choices = {}
    for key in old.linear_choices:
        offered = [candidates(key[-1], True, key[1], MAX_ROWS[b], old.native, packed=True,
                              compute=model.embed.dtype) for b in range(len(BUCKETS))]
        choices[key] = tuple(pick(list(names)) for names in offered)
    model.plan = KernelPlan(choices, "native", old.native, torch.device("cpu"))
    model.chains = DecodeChains.for_model(model)


def loop_and_chain_logits(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    model = engine.runner.model
    chains, model.chains = model.chains, None
    loop = engine_logits(engine, prompt, 1)  # every position a decode step
    model.chains = chains
    return loop, engine_logits(engine, prompt, 1)


@pytest.mark.parametrize("dtype,quantization", FORMATS)
def test_the_chain_has_the_loops_logits_bit_for_bit_with_every_kernel(native, tiny_path, dtype, quantization):
    engine = Engine(tiny_path, dtype=dtype, quantization=quantization, kernels="native", block_size=4)
    model = engine.runner.model
    assert model.chains is not None
    names = {n for key in model.plan.linear_choices
             for n in candidates(key[-1], True, key[1], 1, native, packed=True, compute=model.embed.dtype)}
    kinds = set()
    for name in sorted(names):  # each candidate wherever it is offered, the first offered elsewhere
        plan_choosing(model, lambda offered, name=name: name if name in offered else offered[0])
        weight = model.layers[0].gate_up
        kinds.add(chain_product(model.plan.chosen(weight, 0)[0], weight)[0])
        loop, chain = loop_and_chain_logits(engine, PROMPT)
        assert torch.equal(loop, chain), name
    # the native kernels are called from C++ and the others through the plan's Python function
    native_kinds = {None: {"skinny"}, "int8": {"skinny"}, "int4": {"int4"}, "w4a8": set(), "w8a8": set()}[quantization]
    if hasattr(native, "int8_x16_linear") and quantization in ("int8", "int4"):
        native_kinds.add(f"{quantization}_x16")
    if hasattr(native, "int8_digits_linear") and quantization == "int8":
        native_kinds.add("int8_digits")
    if quantization == "w4a8" and hasattr(native, "w4a8_linear"):
        native_kinds.add("w4a8")
    if quantization == "int4" and dtype == "bfloat16" and hasattr(native, "int4_panel_linear"):
        native_kinds.add("int4_panels")  # its panel copy (bf16 x only)
    if quantization == "int8" and dtype == "bfloat16" and hasattr(native, "int8_panel_linear"):
        native_kinds.add("int8_panels")  # a weight-only int8 weight's panel copy (bf16 x only)
    if quantization is None and dtype == "bfloat16" and hasattr(native, "bf16_panel_linear"):
        native_kinds.add("bf16_panels")  # a dense bf16 weight's panel copy
    if quantization == "w8a8":  # w8a8's tiles and rows (its panels take 9+ rows: never a chain's)
        native_kinds |= {k for k, f in (("w8a8", "w8a8_linear"), ("w8a8_row", "w8a8_row_linear")) if hasattr(native, f)}
    # w4a8's one candidate where its kernel is built is that kernel; every other format also offers torch's products
    python_too = quantization != "w4a8" or not hasattr(native, "w4a8_linear")
    assert kinds == native_kinds | ({"call"} if python_too else set())


@pytest.mark.parametrize("batch", [3, 10])
def test_batched_decode_steps_sample_what_the_loop_samples(native, tiny_path, batch):
    # 3 or 10 sequences a step (the 2-8 and 9-64 buckets), through the whole engine: tokens and logprobs alike
    engine = Engine(tiny_path, dtype="bfloat16", kernels="native", block_size=4)
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(batch)]
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0, logprobs=3)

    def run():
        return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]

    with_chain = run()
    engine.runner.model.chains = None
    assert run() == with_chain
    assert len(with_chain[0][0]) == 10


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "w8a8", "w4a8"])
def test_a_qkv_bias_in_the_chain(native, tiny_path, quantization):
    # Qwen2 adds a bias to its qkv product: each native kernel takes it as the Python function would (in x's dtype)
    engine = Engine(tiny_path, dtype="bfloat16", quantization=quantization, kernels="native", block_size=4)
    model = engine.runner.model
    c = model.config
    generator = torch.Generator().manual_seed(5)
    for layer in model.layers:
        layer.qkv_bias = torch.randn((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, generator=generator).bfloat16()
    model.chains = DecodeChains.for_model(model)
    loop, chain = loop_and_chain_logits(engine, PROMPT)
    assert torch.equal(loop, chain)
    without = engine_logits(Engine(tiny_path, dtype="bfloat16", quantization=quantization, kernels="native",
                                   block_size=4), PROMPT, 1)
    assert not torch.equal(without, chain)  # the bias was added


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_head_q_and_k_norms_in_the_chain(native, tiny_path, dtype):
    # Qwen3 normalizes each head of q and k before the rotation: the chain in the same torch operators
    engine = Engine(tiny_path, dtype=dtype, kernels="native", block_size=4)
    model = engine.runner.model
    generator = torch.Generator().manual_seed(3)
    for layer in model.layers:
        layer.q_norm, layer.k_norm = (1 + 0.3 * torch.randn(2, model.config.head_dim, generator=generator)).to(
            model.embed.dtype)
    model.chains = DecodeChains.for_model(model)
    loop, chain = loop_and_chain_logits(engine, PROMPT)
    assert torch.equal(loop, chain)
    model.layers[1].k_norm = None
    with pytest.raises(RuntimeError, match="a q norm goes with a k norm"):
        model.chains._build(0)


def test_models_and_plans_it_leaves_to_the_loop(native, tiny_path):
    engine = Engine(tiny_path, dtype="float32", kernels="native")
    model = engine.runner.model
    model.plan.attention_choice = "torch"  # the chain always attends with the native kernel
    assert DecodeChains.for_model(model) is None
    torch_only = Engine(tiny_path, dtype="float32", kernels="torch").runner.model
    assert torch_only.chains is None and "decode_chain" not in torch_only.kernel_summary
    assert Engine(tiny_path, dtype="float32", kernels="native").runner.model.kernel_summary.endswith(
        "; decode steps: one native call (decode_chain)")


def test_bad_products_and_steps_are_refused(native, tiny_path):
    with pytest.raises(RuntimeError, match="no chain kernel named"):
        native.ChainProduct("gemv", [], None, [], None)
    with pytest.raises(RuntimeError, match="takes 2 tensors and 3 options"):
        native.ChainProduct("skinny", [torch.zeros(2, 2)], None, [1, 0, 0], None)
    with pytest.raises(RuntimeError, match="needs a callable"):
        native.ChainProduct("call", [], None, [], None)
    engine = Engine(tiny_path, dtype="float32", kernels="native")
    model, runner = engine.runner.model, engine.runner
    chain = model.chains._build(0)
    h = torch.zeros(1, model.config.hidden_size)
    cos = sin = torch.zeros(1, model.config.head_dim)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    outside = torch.tensor([runner.kv_slots.shape[2]])
    with pytest.raises(RuntimeError, match="outside the pool"):
        chain.run(h, h.clone(), runner.kv_slots, outside, tables, lens, engine.block_manager.block_size, cos, sin)
    with pytest.raises(RuntimeError, match="one int64 slot per row"):
        chain.run(h, h.clone(), runner.kv_slots, torch.zeros(2, dtype=torch.int64), tables, lens, 16, cos, sin)


def test_the_benchmark_alternates_chain_and_loop_steps(native):
    from argparse import Namespace

    from benchmarks.decode_chain import measure

    args = Namespace(preset="tiny", dtype="float32", threads=torch.get_num_threads(), context=20, rounds=3)
    result = measure(args, "int8", 2)
    assert result["quantization"] == "int8" and result["batch"] == 2
    assert [len(result["times"][k]) for k in ("loop", "chain")] == [3, 3] and 0 <= result["chain_won"] <= 3
    assert result["difference_ms"] == sorted(a - b for a, b in zip(result["times"]["loop"], result["times"]["chain"]))[1]


def test_an_error_in_a_called_back_product_reaches_the_caller(native, tiny_path):
    engine = Engine(tiny_path, dtype="float32", kernels="native", block_size=4)
    model = engine.runner.model
    plan_choosing(model, lambda offered: "torch.linear" if "torch.linear" in offered else offered[0])

    def broken(x, weight, bias):
        raise ValueError("a product failed")

    key = weight_key(model.layers[0].o)
    model.plan._table[key] = (broken,) * len(BUCKETS)
    model.chains = DecodeChains.for_model(model)
    with pytest.raises(ValueError, match="a product failed"):
        engine_logits(engine, PROMPT, 1)
    model.plan = KernelPlan.choose([model.lm_head] + [w for layer in model.layers
                                                      for w in (layer.qkv, layer.o, layer.gate_up, layer.down)],
                                   (model.num_heads, model.num_kv_heads, model.config.head_dim), model.embed.dtype,
                                   torch.device("cpu"), "native")
    model.chains = DecodeChains.for_model(model)
    loop, chain = loop_and_chain_logits(engine, PROMPT)  # the engine goes on: Python's lock was given back
    assert torch.equal(loop, chain)
