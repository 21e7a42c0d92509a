"""A real model in 16 bits, int8, int4 and w4a8: load time, batch-1 decode time per token, and how far the
quantized weights move the model on real text (docs/models.md).

For the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) or any `--model`: the time to convert the GGUF
(a fresh cache folder) and to load it; per variant (bf16, and int8 / int4 weight-only decode made at load), the
median over `--rounds` of (generate 65 tokens - generate 1 token) / 64 at batch 1 (and, where llama-cpp-python
is installed, llama.cpp's median `eval([token])` on the GGUF file as it is); and, teacher-forced on the
opening of Pride and Prejudice (~350 tokens, public domain), how often int8's / int4's top token equals bf16's and the
mean |Δ logprob| of the text's own next token — fed whole (prefill's products) and one token a step
(decode's one-row products).

    python -m benchmarks.real_model_int8 --threads 2
    python -m benchmarks.real_model_int8 --threads 2 --llama-quantize Q4_0   # the file re-quantized by llama.cpp first
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.report import environment, format_table, write_results
from services import Engine, SamplingParams

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him "
    "one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But "
    "it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made "
    "no answer. \"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, "
    "and I have no objection to hearing it.\" This was invitation enough. \"Why, my dear, you must know, Mrs. "
    "Long says that Netherfield is taken by a young man of large fortune from the north of England; that he came "
    "down on Monday in a chaise and four to see the place, and was so much delighted with it, that he agreed "
    "with Mr. Morris immediately; that he is to take possession before Michaelmas, and some of his servants are "
    "to be in the house by the end of next week.\" \"What is his name?\" \"Bingley.\" \"Is he married or "
    "single?\" \"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. "
    "What a fine thing for our girls!\""
)


def convert_and_load(model: str) -> tuple[float, float]:
    """Seconds to convert `model` (a .gguf) into a fresh cache folder, then to build an engine on the result."""
    from services.gguf_folder import converted_folder

    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("PDSERVE_CACHE")
        os.environ["PDSERVE_CACHE"] = cache
        try:
            start = time.perf_counter()
            converted_folder(model)
            converted = time.perf_counter() - start
        finally:
            os.environ.pop("PDSERVE_CACHE") if old is None else os.environ.__setitem__("PDSERVE_CACHE", old)
    start = time.perf_counter()
    Engine(model=model, dtype="bfloat16", max_model_len=512)
    return converted, time.perf_counter() - start


def engine_decode_ms(engine: Engine, prompt: list[int]) -> Callable[[], float]:
    """A timer of ms per decode token: (generate 65 tokens - generate 1 token) / 64."""
    def timed(n: int) -> float:
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    timed(8)  # warm-up
    return lambda: (timed(65) - timed(1)) / 64 * 1e3


def median_in_turns(timers: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each timer's median; they take turns in every round, so a busy spell of the shared host falls on all."""
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            samples[name].append(timer())
    return {name: statistics.median(values) for name, values in samples.items()}


def text_logprobs(engine: Engine, ids: list[int]) -> list[dict[int, float]]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    return engine.generate([ids], params)[0].prompt_logprobs  # entry i: token i+1 given tokens 0..i


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file or folder (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--llama-quantize", metavar="FTYPE", help="first re-quantize the GGUF with llama.cpp's own "
                        "quantizer (llama-cpp-python, the `bench` extra) to FTYPE: Q4_0, Q8_0, Q4_K_M, ...; the file is "
                        "written beside it once")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from services.default_model import default_gguf

        args.model = str(default_gguf())
    if args.llama_quantize:
        from benchmarks.llama_gguf import quantize_like_llama_cpp

        source = Path(args.model)
        args.model = str(quantize_like_llama_cpp(source, source.with_name(f"{source.stem}-{args.llama_quantize}.gguf"),
                                                 args.llama_quantize))
    converted_s, load_s = convert_and_load(args.model) if args.model.endswith(".gguf") else (None, None)
    options = dict(max_model_len=512, enable_prefix_caching=False, num_threads=args.threads)
    variants = {"float32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("bfloat16", "int8"),
                "int4": ("bfloat16", "int4"), "w4a8": ("bfloat16", "w4a8")}
    engines = {name: Engine(model=args.model, dtype=d, quantization=q, **options) for name, (d, q) in variants.items()}
    # the text fed one token a step: every product has one row, as in decode (where the plan's few-row kernels
    # run: on AVX2 CPUs the x16 ones), not prefill's dequantized dense products
    stepwise = {f"{name}, one token a step": Engine(model=args.model, dtype="bfloat16", quantization=name,
                                                    max_num_batched_tokens=1, max_num_seqs=1, **options)
                for name in ("int8", "int4")}
    ids = engines["bf16"].tokenizer.encode(TEXT)
    timers = {name: engine_decode_ms(engine, ids[:32]) for name, engine in engines.items()}
    if args.model.endswith(".gguf") and importlib.util.find_spec("llama_cpp") is not None:
        from benchmarks.vs_llama_cpp import LlamaCppRunner

        # llama.cpp on the file itself (Q4_1 for the default model): median time of one eval([token])
        timers["llama.cpp (the GGUF as is)"] = functools.partial(LlamaCppRunner(args.model, args.threads).decode_ms, 64)
    ms = median_in_turns(timers, args.rounds)
    logprobs = {name: text_logprobs(engine, ids) for name, engine in {**engines, **stepwise}.items()}
    quality = {}
    for variant, reference in (("bf16", "float32"), ("int8", "float32"), ("int8", "bf16"), ("int4", "float32"),
                               ("int4", "bf16"), ("w4a8", "float32"), ("w4a8", "int4"),
                               *((name, "float32") for name in stepwise)):
        ours, theirs = logprobs[variant], logprobs[reference]
        quality[f"{variant} vs {reference}"] = (
            sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(ours, theirs)) / len(ours),
            statistics.fmean(abs(a[t] - b[t]) for a, b, t in zip(ours, theirs, ids[1:])))
    env = environment()
    print(f"{args.model}; {env['cpu']}; {args.threads} threads; load average {os.getloadavg()[0]:.1f}")
    if converted_s is not None:
        print(f"GGUF -> folder: {converted_s:.1f} s (once); engine load from the folder: {load_s:.1f} s")
    kept = {name: e.runner.model.formats.summary for name, e in engines.items() if e.runner.model.formats.summary}
    print(format_table(["variant", "decode ms/token (batch 1)"], [[name, value] for name, value in ms.items()]))
    for name, summary in kept.items():  # a 4-bit file's matrices in the format that holds them (docs/models.md)
        print(f"{name}: {summary}")
    print(f"\nteacher-forced on {len(ids) - 1} tokens of text:")
    print(format_table(["pair", "top-1 agreement", "mean |Δ logprob|"],
                       [[pair, f"{agree:.1%}", delta] for pair, (agree, delta) in quality.items()]))
    path = write_results("real_model_int8", {
        "environment": env, "model": args.model, "load_average": os.getloadavg()[0], "convert_s": converted_s,
        "load_s": load_s, "decode_ms_per_token": ms, "kept_as_the_file_holds_them": kept,
        "num_text_tokens": len(ids) - 1,
        "quality": {pair: {"top1_agreement": a, "mean_abs_delta_logprob": d} for pair, (a, d) in quality.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
