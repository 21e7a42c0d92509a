"""Dense bf16 weights in 16-row panels (bf16_panel_linear.cpp, bf16_panels.py): the product against the exact one on odd
shapes, the candidates, the plan's rules about copies, and an engine whose weights are held as their panels alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services import Engine, SamplingParams
from services.kernels import kernel_plan
from services.kernels.bf16_panels import BF16_PANELS, ValuesDropped, panel_copy, without_values
from services.kernels.linear_candidates import candidates
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.kernels.weight_layouts import reads_three_layouts
from services.model import LlamaModel
from services.roofline import ModelCost

SHAPES = [(9, 172), (33, 2048), (5, 64), (40, 100), (16, 8), (17, 1), (48, 96)]
PANEL_NAMES = ("native.panels", "native.panels.nt", "native.panels.2streams", "native.panels.4streams.nt")


@pytest.fixture
def product(native):
    if not hasattr(native, "bf16_panel_linear"):
        pytest.skip("the bf16 panel kernel is built only where the CPU has AVX512-BF16")
    return native.bf16_panel_linear


def test_the_copy_lays_out_column_pairs_of_16_rows():
    w = torch.arange(20 * 10, dtype=torch.float32).view(20, 10).bfloat16()
    panels = panel_copy(w).panels  # [2 panels, 8 pairs (10 columns padded to 16), 16 rows]
    assert panels.shape == (2, 8, 16) and panels.dtype == torch.int32
    pairs = panels.view(torch.bfloat16).view(2, 8, 16, 2)
    assert torch.equal(pairs[1, 2, 3], w[19, 4:6])  # panel 1, pair 2, lane 3: row 19, columns 4 and 5
    assert torch.equal(pairs[1, :, 4:].float(), torch.zeros(8, 12, 2))  # rows past N
    assert torch.equal(pairs[0, 5:].float(), torch.zeros(3, 16, 2))  # columns past K


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 70])
def test_the_product_is_the_exact_one_rounded_once(product, out_features, in_features, rows):
    g = torch.Generator().manual_seed(out_features * in_features + rows)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x, bias = torch.randn(rows, in_features, generator=g).bfloat16(), torch.randn(out_features, generator=g)
    exact = x.double() @ w.double().T + bias.double()
    # the products are exact in float32, their sums float32 in another order than the reference: within bf16's
    # rounding of the result and float32's of a K-term sum
    bound = 2**-8 * exact.abs() + in_features * 2**-24 * (x.double().abs() @ w.double().abs().T)
    panels = panel_copy(w).panels
    answers = [product(x, panels, out_features, bias, streams, nt) for streams in (1, 2, 4) for nt in (False, True)]
    assert answers[0].dtype == torch.bfloat16 and answers[0].shape == (rows, out_features)
    assert ((answers[0].double() - exact).abs() <= bound).all()
    assert all(torch.equal(a, answers[0]) for a in answers)  # how W is streamed does not change an output's sum
    assert torch.equal(product(x, panels, out_features, None, 1, False).float(),
                       product(x, panels, out_features, torch.zeros(out_features), 1, False).float())


def test_bad_calls_are_refused(product):
    panels = panel_copy(torch.randn(20, 64).bfloat16()).panels
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a CPU bfloat16"):
        product(x.float(), panels, 20, None, 1, False)
    with pytest.raises(RuntimeError, match=r"panels must be a contiguous CPU int32 \[3, 32, 16\]"):
        product(x, panels, 40, None, 1, False)
    with pytest.raises(RuntimeError, match="panels must be"):
        product(torch.randn(2, 80).bfloat16(), panels, 20, None, 1, False)
    with pytest.raises(RuntimeError, match="streams must be 1, 2 or 4"):
        product(x, panels, 20, None, 3, False)
    with pytest.raises(RuntimeError, match="bias must have N elements"):
        product(x, panels, 20, torch.zeros(19), 1, False)


def test_the_candidates_offer_the_panels_for_bf16_x_where_copies_are_allowed(native, product):
    assert set(PANEL_NAMES) <= set(candidates("bfloat16", True, 64, 1, native, True, torch.bfloat16))
    for max_rows in (8, 64, 1 << 62):
        found = candidates("bfloat16", True, 64, max_rows, native, True, torch.bfloat16)
        assert {n for n in found if n.startswith("native.panels")} == {"native.panels", "native.panels.nt"}
    assert not any(n.startswith("native.panels") for n in candidates("bfloat16", True, 64, 1, native, False,
                                                                      torch.bfloat16))  # no copies allowed
    for weight_format, compute in (("float32", torch.float32), ("bfloat16", torch.float32), ("float16", None)):
        assert not any(n.startswith("native.panels") for n in candidates(weight_format, True, 64, 8, native, True,
                                                                          compute))
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 100, generator=g).bfloat16(), torch.randn(5, 100, generator=g).bfloat16()
    found = candidates("bfloat16", True, 100, 8, native, True, torch.bfloat16)
    assert torch.equal(found["native.panels"](x, w, None), product(x, BF16_PANELS.copy(w).panels, 40, None, 1, False))
    BF16_PANELS.drop(w)


def test_a_weight_never_keeps_three_layouts():
    assert reads_three_layouts(("native", "native.panels", "onednn.packed", "onednn.packed"))
    assert not reads_three_layouts(("native.panels", "native.panels", "onednn.packed", "onednn.packed"))  # no rows
    assert not reads_three_layouts(("native", "native.4parts", "onednn.packed", "onednn.packed"))  # no panels
    assert not reads_three_layouts(("native.panels.nt", "native.panels", "native.panels", "torch.linear"))


def test_the_plan_chooses_again_without_the_panels_where_a_weight_would_keep_three_layouts(native, product, tmp_path,
                                                                                          monkeypatch):
    if not ONEDNN_PACKS.supported(torch.bfloat16):
        pytest.skip("this torch build has no oneDNN bf16 packing on this CPU")
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path / "first")
    picks = {1: "native", 4: "native.panels", 32: "onednn.packed", 128: "onednn.packed"}

    def fake(fns, device, rows, before=None, after=None, prefer=None):
        pick = picks.get(rows)  # (the attention is timed too: its own rows)
        return pick if pick in fns else "native.4parts" if "native.4parts" in fns else next(iter(fns))

    monkeypatch.setattr(kernel_plan, "_fastest", fake)
    w = torch.randn(48, 96).bfloat16()
    plan = kernel_plan.KernelPlan.choose([w], (2, 1, 16), torch.bfloat16, torch.device("cpu"))
    assert plan.linear_choices[(48, 96, "bfloat16")] == ("native", "native.4parts", "onednn.packed", "onednn.packed")
    assert not BF16_PANELS.holds(w) and ONEDNN_PACKS.holds(w)
    picks.update({1: "native.panels.4streams", 4: "native.panels", 32: "native.panels.nt"})
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path / "second")  # not the first plan's choices
    plan = kernel_plan.KernelPlan.choose([w], (2, 1, 16), torch.bfloat16, torch.device("cpu"))
    assert plan.linear_choices[(48, 96, "bfloat16")] == (
        "native.panels.4streams", "native.panels", "native.panels.nt", "onednn.packed")  # two copies, no rows read
    assert not plan.reads_rows(w) and BF16_PANELS.holds(w) and ONEDNN_PACKS.holds(w)
    BF16_PANELS.drop(w)
    ONEDNN_PACKS.drop(w)


def test_a_weight_without_values_fails_every_reader_at_once(product):
    w = torch.randn(40, 100).bfloat16()
    copy = BF16_PANELS.copy(w)
    stand_in = without_values(w)
    BF16_PANELS.rekey(w, stand_in)
    assert (stand_in.shape, stand_in.dtype, stand_in.nbytes) == (w.shape, w.dtype, w.nbytes)
    assert BF16_PANELS.copy(stand_in) is copy and not BF16_PANELS.holds(w)
    for read in (lambda: F.linear(torch.randn(2, 100).bfloat16(), stand_in), lambda: stand_in[3], stand_in.float):
        with pytest.raises(RuntimeError, match="read a weight whose values were dropped"):
            read()
    BF16_PANELS.drop(stand_in)


def test_the_engine_holds_its_weights_as_panels_alone_and_answers_the_same(product, tiny_path, tmp_path, monkeypatch):
    """The plan forced to the panels in every bucket: the rows of every matrix are freed, and the answers (the decode chain's, prefill's through the forward) are the ones of the same plan with the
    rows kept, bit for bit, with the same roofline bytes."""
    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(kernel_plan, "_fastest", lambda fns, *a, **k: next(  # the attention: native (the chain's)
        (n for n in (*PANEL_NAMES[:2], "native") if n in fns), next(iter(fns))))
    prompts = [[1] + [5 + i % 200 for i in range(90)], [1, 7, 8, 9]]  # 91 tokens: prefill's bucket (65+)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)

    def run() -> tuple[list, ModelCost, list, bool]:
        engine = Engine(model=str(tiny_path), dtype="bfloat16", num_threads=1, kernels="auto")
        model = engine.runner.model
        held = [type(getattr(layer, n)) is ValuesDropped for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
        held.append(type(model.lm_head) is ValuesDropped)
        cost = ModelCost.of(model, 0)
        return held, cost, [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)], model.chains

    dropped, cost, answers, chains = run()
    monkeypatch.setattr(LlamaModel, "_drop_unread_layouts", lambda self: None)
    kept, cost_kept, again, _ = run()
    assert chains is not None  # decode steps ran the chain's bf16_panels kernel
    assert all(dropped) and not any(kept)  # tiny's output projection is its own (a tied one keeps its rows)
    assert answers == again and cost == cost_kept


def test_a_tied_embedding_is_gathered_from_the_panels(product, tiny_path, tmp_path, monkeypatch):
    """tiny with its output projection tied to the embedding (a copy of its folder): forced to the panels, the table's
    rows go too and the embedding gathers them from the panel copy — the same answers as with the rows kept."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied"
    shutil.copytree(tiny_path, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    w = weights["model.embed_tokens.weight"].bfloat16()
    ids = torch.tensor([0, 17, 3, 511, 16, 17])
    assert torch.equal(BF16_PANELS.rows(w, ids), w[ids])
    BF16_PANELS.drop(w)

    monkeypatch.setattr(kernel_plan, "cache_root", lambda: tmp_path / "choices")
    monkeypatch.setattr(kernel_plan, "_fastest", lambda fns, *a, **k: next(
        (n for n in (*PANEL_NAMES[:2], "native") if n in fns), next(iter(fns))))
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    prompts = [[1] + [5 + i % 200 for i in range(70)], [1, 7, 8, 9]]

    def run() -> tuple[bool, list]:
        model = (engine := Engine(model=str(tied), dtype="bfloat16", num_threads=1, kernels="auto")).runner.model
        assert model.embed is model.lm_head
        return type(model.embed) is ValuesDropped, [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]

    dropped, answers = run()
    monkeypatch.setattr(LlamaModel, "_drop_unread_layouts", lambda self: None)
    kept, again = run()
    assert dropped and not kept and answers == again
