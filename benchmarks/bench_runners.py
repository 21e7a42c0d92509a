"""The systems `benchmarks.vs_llama_cpp` times side by side, each behind the same three calls: batch-1 decode ms per
token after PROMPT, the prefill of LONG, and (pdserve only) a batch step's median ms with long contexts."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from services import Engine, SamplingParams
from services.kv_payload import KVPayload
from services.scheduler import SampledToken

PROMPT = list(range(300, 300 + 128))
LONG = list(range(300, 300 + 1024))


class PdserveRunner:
    def __init__(self, folder, dtype: str, quantization: str | None) -> None:
        self.engine = Engine(folder, dtype=dtype, quantization=quantization, max_num_seqs=32, max_model_len=2048,
                             max_num_batched_tokens=2048,
                             # 32 sequences of 1,024 tokens need 1.1 GB of 16-bit KV (2.2 GB in float32)
                             kv_cache_memory_gb=1.5 if dtype != "float32" else 3.0)
        self.ids = iter(range(10**9))

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests:
            self.engine.step()

    def decode_ms(self, num_tokens: int) -> float:
        params = SamplingParams(max_tokens=num_tokens + 2, temperature=0, ignore_eos=True)
        self.engine.add_request(f"d{next(self.ids)}", PROMPT, params)
        self.engine.step()  # the prefill
        return self._median_step_ms(num_tokens)

    def prefill_ms(self) -> float:
        self.engine.add_request(f"p{next(self.ids)}", [t + next(self.ids) % 7 for t in LONG],  # no prefix hit
                                SamplingParams(max_tokens=1, temperature=0))
        start = time.perf_counter()
        self._drain()
        return (time.perf_counter() - start) * 1e3

    def batch_decode_ms(self, batch: int, context: int, steps: int) -> float:
        c = self.engine.model_config
        rng = np.random.default_rng(0)
        shape = (c.num_layers, 2, context, c.num_kv_heads, c.head_dim)
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[self.engine.dtype]
        array = (rng.standard_normal(shape, dtype=np.float32) * 0.5)
        array = torch.from_numpy(array).bfloat16().view(torch.int16).numpy() if name == "bfloat16" else array
        params = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
        for i in range(batch):
            kv = KVPayload.from_array(array, name)
            self.engine.add_prefilled(f"b{next(self.ids)}-{i}", [300 + i] * context, SampledToken(5, None), params, kv)
        self.engine.step()  # imports every KV
        return self._median_step_ms(steps)

    def _median_step_ms(self, num_steps: int) -> float:
        """After one untimed step, the median of `num_steps` timed ones; then the rest run out."""
        self.engine.step()
        times = []
        for _ in range(num_steps):
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
        self._drain()
        return statistics.median(times) * 1e3

    def decode_bytes(self, context_lens: list[int]) -> int:
        return self.engine.runner.cost.decode_bytes(context_lens)


class LlamaCppRunner:
    def __init__(self, path, threads: int) -> None:
        from llama_cpp import Llama

        self.weight_bytes = os.path.getsize(path)  # every weight once a step (the output matrix is the embedding)
        self.llm = Llama(model_path=str(path), n_ctx=2048, n_batch=1024, n_ubatch=1024, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def decode_ms(self, num_tokens: int) -> float:
        self.llm.reset()
        self.llm.eval(PROMPT)
        times = []
        for i in range(num_tokens):
            start = time.perf_counter()
            self.llm.eval([400 + i])
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def prefill_ms(self) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(LONG)
        return (time.perf_counter() - start) * 1e3


class TransformersRunner:
    def __init__(self, folder, dtype: torch.dtype) -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()

    @torch.inference_mode()
    def decode_ms(self, num_tokens: int) -> float:
        out = self.model(torch.tensor([PROMPT]), use_cache=True)
        cache, times = out.past_key_values, []
        for i in range(num_tokens):
            start = time.perf_counter()
            out = self.model(torch.tensor([[400 + i]]), past_key_values=cache, use_cache=True)
            out.logits[0, -1].argmax()
            times.append(time.perf_counter() - start)
            cache = out.past_key_values
        return statistics.median(times) * 1e3

    @torch.inference_mode()
    def prefill_ms(self) -> float:
        start = time.perf_counter()
        self.model(torch.tensor([LONG]), use_cache=True, logits_to_keep=1).logits.argmax()
        return (time.perf_counter() - start) * 1e3

