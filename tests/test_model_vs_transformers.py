"""Logits equal transformers' for tiny random models of every supported architecture (float32)."""

from __future__ import annotations

import pytest
import torch

from services import Engine, SamplingParams
from services.kernels import kernel_plan
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.scheduler import ScheduledBatch
from services.sequence import Sequence

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def llama3():
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def llama2_untied():
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, tie_word_embeddings=False)


def mistral():
    from transformers import MistralConfig

    return MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False)


def qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**COMMON, tie_word_embeddings=True)


def qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False)  # head_dim != hidden/heads


ARCHITECTURES = {"llama3": llama3, "llama2_untied": llama2_untied, "mistral": mistral, "qwen2": qwen2,
                 "qwen3": qwen3}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model_pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from services.model_presets import write_model

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(ARCHITECTURES[request.param](), torch_dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases too, so a missed one shows up
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 2 else 0.2) + (1.0 if "norm" in name else 0.0))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    tiny = write_model("tiny", tmp_path_factory.mktemp("tok"), seed=0)  # borrow a tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny / name).read_bytes())
    def engine(kernels: str, device: str = "auto") -> Engine:
        return Engine(model=folder, dtype="float32", block_size=4, max_num_batched_tokens=64, kernels=kernels,
                      device=device)

    engines = {kernels: engine(kernels) for kernels in ("native", "torch")}
    with pytest.MonkeyPatch.context() as patch:  # oneDNN's packed weights wherever offered, in a cache of their own
        patch.setattr(kernel_plan, "cache_root", lambda: tmp_path_factory.mktemp("kernel-cache"))
        patch.setattr(kernel_plan, "_fastest", lambda fns, device, rows, before=None, after=None, prefer=None: next(
            (n for n in fns if n == "onednn.packed"), next(iter(fns))))
        engines["packed"] = engine("torch", device="cpu")  # oneDNN packs are CPU kernels (on a GPU host too)
    return hf, engines


def engine_logits(engine: Engine, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, feeding `chunk` tokens per step through the paged pool
    (chunk=1: the decode path; chunk=len(prompt): one prefill)."""
    runner = engine.runner
    seq = Sequence("probe", list(prompt), len(prompt), SamplingParams(), 0, 0)
    engine.block_manager.allocate(seq, len(prompt))
    rows = []
    for start in range(0, len(prompt), chunk):
        n = min(chunk, len(prompt) - start)
        seq.num_computed_tokens = start
        batch = ScheduledBatch([seq], [n])
        meta = runner._attention_metadata(batch, list(range(start, start + n)), [0] * n)
        with torch.inference_mode():
            rows.append(runner.model.forward(runner._tensor(prompt[start : start + n]),
                                             runner._tensor(list(range(start, start + n))), meta,
                                             runner.kv_slots, runner._tensor(list(range(n)))))
    engine.block_manager.free(seq)
    return torch.cat(rows)


@pytest.mark.parametrize("kernels", ["native", "torch", "packed"])
def test_prefill_and_decode_logits_match(model_pair, kernels):
    hf, engines = model_pair
    engine = engines[kernels]
    if kernels == "packed":
        if not ONEDNN_PACKS.supported(torch.float32):
            pytest.skip("this torch build packs no float32 weights for oneDNN")
        assert all(names == ("onednn.packed",) * 4 for names in engine.runner.model.plan.linear_choices.values())
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    for chunk in (40, 1, 7):  # one prefill, pure decode, prefill chunks over a cached prefix
        torch.testing.assert_close(engine_logits(engine, prompt, chunk).cpu(), want, rtol=1e-4, atol=1e-4)
    # greedy continuation through the whole engine (prefill path, then paged decode)
    ids = torch.tensor([prompt])
    hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                            min_new_tokens=8, pad_token_id=0)[0, 40:].tolist()
    out = engine.generate([prompt], SamplingParams(max_tokens=8, min_tokens=8, temperature=0))[0]
    assert out.token_ids == hf_tokens
