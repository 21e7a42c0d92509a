"""The flag groups several `pdserve` commands share, and what they become."""

from __future__ import annotations

import argparse
import os

from router import cli_values as flags
from services.engine_config import KERNEL_MODES, QUANTIZATIONS

DEFAULT_MODEL = "smollm2"  # services/default_model.py: SmolLM2-135M-Instruct, fetched once; `tiny` offline
MODEL_HELP = ("a model folder, a .gguf file (converted once into the cache), a preset (tiny, small, 1b: random "
              "weights, generated on first use), or smollm2 (default: SmolLM2-135M-Instruct, fetched once)")


def kernel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", choices=("none", *QUANTIZATIONS), default="none",
                        help="quantization of the linear layers, made at load: weight-only int8 (per output "
                             "channel) or int4 (per 32 columns, lm_head int8); w8a8: int8 weights, and every product "
                             "rounds each activation row to int8 too (int8 x int8: fast prefill; for decode "
                             "workers int8 is faster); w4a8: int4 weights, and every product rounds the activations "
                             "to int8 per 32 columns (llama.cpp's Q4 arithmetic: int8 dot products on AVX512-VNNI "
                             "CPUs, a faster prefill than int4's, slightly less accurate)")
    parser.add_argument("--kernels", choices=KERNEL_MODES, default=None,
                        help="auto (default, or $PDSERVE_KERNELS): the fastest kernels measured on this host "
                             "(cached); torch: torch's only; native: the native CPU kernels wherever they run")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs")


def quantization(name: str | None) -> str | None:
    return None if name == "none" else name


def kernels(args: argparse.Namespace) -> dict[str, object]:
    options: dict[str, object] = {} if args.kernels is None else {"kernels": args.kernels}
    if args.enforce_eager:
        options["enforce_eager"] = True
    return options


def router_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the router itself, shared by `serve` and `router`."""
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the folder name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=flags.port, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                       help="require this Bearer key on every route but /health (default: $PDSERVE_API_KEY; none: open)")
    parser.add_argument("--metrics-without-key", action="store_true",
                       help="with --api-key, leave /metrics open (Prometheus can also send the key as a bearer token)")
    parser.add_argument("--local-prefill-tokens", type=flags.local_prefill, default=0,
                       help="disaggregated: prompts of at most this many tokens are prefilled by their decode worker "
                            "(no KV hand-off; 0: never); auto: a cost model decides per request")
    parser.add_argument("--request-timeout", type=flags.positive_float, default=None,
                       help="seconds a completion may take; past it the request is aborted and answered 504 "
                            "(a stream ends with a 504 error event); default: no limit")
    parser.add_argument("--max-pending", type=flags.positive_int, default=1024,
                       help="completions in flight through the router; one more gets 429 + Retry-After")


def router_options(args: argparse.Namespace) -> dict:
    return dict(api_key=args.api_key, metrics_without_key=args.metrics_without_key, max_pending=args.max_pending,
                local_prefill_tokens=args.local_prefill_tokens, request_timeout=args.request_timeout)
