"""The `pdserve` command: serve (the cluster and its router), router (one more router), scale (the
workers), make-model, and generate (offline).

Subcommands import what they need when they run, so this module imports no torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from router import cli_values as flags
from services.engine_config import KERNEL_MODES, QUANTIZATIONS

PRESETS = ("tiny", "small", "1b")
DEFAULT_MODEL = "smollm2"  # services/default_model.py: SmolLM2-135M-Instruct, fetched once; `tiny` offline
MODEL_HELP = ("a model folder, a .gguf file (converted once into the cache), a preset (tiny, small, 1b: random "
              "weights, generated on first use), or smollm2 (default: SmolLM2-135M-Instruct, fetched once)")

# Commands defined in their own modules: each has `add_command(subparsers)`, which registers its parser and
# sets `run=` (a function of the parsed arguments) as a default. Importing one must not load torch.
COMMAND_MODULES: tuple[str, ...] = ("benchmarks.bench_command", "benchmarks.study_command",
                                     "benchmarks.roofline_command", "router.chaos")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="write a Hugging Face model folder with deterministic random weights")
    make.add_argument("--preset", choices=PRESETS, required=True)
    make.add_argument("--out", required=True, help="folder to create")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="weight dtype on disk (default: the preset's)")

    serve = sub.add_parser("serve", help="start (or join) Ray, create the workers, serve the OpenAI API")
    serve.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    serve.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    serve.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    serve.add_argument("--prefill", type=flags.positive_int, default=1, help="prefill workers (disaggregated)")
    serve.add_argument("--decode", type=flags.positive_int, default=1, help="decode workers (disaggregated)")
    serve.add_argument("--workers", type=flags.positive_int, default=2, help="workers (colocated)")
    serve.add_argument("--address", default=None, help="join a Ray cluster (auto or HOST:PORT); default: start one")
    serve.add_argument("--namespace", default="pdserve")
    serve.add_argument("--prefill-resource", default="pd_prefill")
    serve.add_argument("--decode-resource", default="pd_decode")
    serve.add_argument("--prefill-labels", type=flags.labels, default=None,
                       help="place prefill workers by node labels instead, e.g. pdserve/role=prefill")
    serve.add_argument("--decode-labels", type=flags.labels, default=None,
                       help="place decode workers by node labels instead, e.g. pdserve/role=decode")
    serve.add_argument("--max-model-len", type=flags.positive_int, default=None)
    serve.add_argument("--max-num-seqs", type=flags.positive_int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=flags.positive_int, default=2048)
    serve.add_argument("--block-size", type=flags.positive_int, default=16)
    serve.add_argument("--num-kv-blocks", type=flags.positive_int, default=None)
    serve.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    serve.add_argument("--no-prefix-caching", action="store_true")
    _kernel_flags(serve)
    serve.add_argument("--prefill-quantization", choices=("none", *QUANTIZATIONS), default=None,
                       help="the prefill workers' (default: --quantization)")
    serve.add_argument("--decode-quantization", choices=("none", *QUANTIZATIONS), default=None,
                       help="the decode workers' (default: --quantization; colocated workers are decode workers)")
    serve.add_argument("--peak-tflops", type=flags.positive_float, default=None,
                       help="each worker's matmul peak for the efficiency gauges (default: measured at start-up)")
    serve.add_argument("--peak-gbps", type=flags.positive_float, default=None,
                       help="each worker's memory bandwidth, GB/s, for the gauges (default: measured at start-up)")
    serve.add_argument("--no-pin-cpus", action="store_true", help="do not pin each local worker to its own cores")
    serve.add_argument("--gpus-per-worker", type=flags.gpu_share, default=None,
                       help="GPUs each worker asks Ray for, 0..1 (default auto: one each where the cluster has "
                            "GPUs, shared evenly on one local host; none without)")
    serve.add_argument("--worker-restarts", type=flags.non_negative_int, default=3,
                       help="times Ray starts a dead worker again (it reloads the model)")
    serve.add_argument("--detached", action="store_true", help="workers outlive this process")
    serve.add_argument("--tensor-parallel-size", type=flags.positive_int, default=1,
                       help="ranks per worker, sharding the model (docs/tensor-parallel.md)")
    serve.add_argument("--prefill-tensor-parallel-size", type=flags.positive_int, default=None,
                       help="ranks per prefill worker (default: --tensor-parallel-size)")
    serve.add_argument("--decode-tensor-parallel-size", type=flags.positive_int, default=None,
                       help="ranks per decode worker (default: --tensor-parallel-size; colocated workers are decode)")
    _router_flags(serve)

    router = sub.add_parser("router", help="one more router for workers already running (they are shared by name)")
    router.add_argument("--address", default="auto", help="the Ray cluster (default auto)")
    router.add_argument("--namespace", default="pdserve")
    router.add_argument("--model", default=None, help="the model folder on this host (default: the workers' own)")
    router.add_argument("--wait", type=flags.non_negative_float, default=60.0, help="seconds to wait for a decode worker")
    _router_flags(router)

    scale = sub.add_parser("scale", help="add or remove workers of a running deployment (its routers keep running)")
    scale.add_argument("--address", default="auto", help="the Ray cluster (default auto)")
    scale.add_argument("--namespace", default="pdserve")
    scale.add_argument("--prefill", type=flags.positive_int, default=None, help="prefill workers wanted")
    scale.add_argument("--decode", type=flags.positive_int, default=None, help="decode workers wanted")
    scale.add_argument("--drain-timeout", type=flags.non_negative_float, default=30.0,
                       help="seconds a removed worker may finish its requests; what is left then resumes elsewhere")
    scale.add_argument("--startup-timeout", type=flags.positive_float, default=300.0)
    scale.add_argument("--prefill-tensor-parallel-size", type=flags.positive_int, default=None,
                       help="ranks of each prefill worker added (default: like the existing ones)")
    scale.add_argument("--decode-tensor-parallel-size", type=flags.positive_int, default=None,
                       help="ranks of each decode worker added (default: like the existing ones)")

    gen = sub.add_parser("generate", help="generate offline with the engine (no Ray, no HTTP)")
    gen.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    gen.add_argument("--max-tokens", type=flags.positive_int, default=32)
    gen.add_argument("--temperature", type=flags.non_negative_float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    gen.add_argument("--tensor-parallel-size", type=flags.positive_int, default=1,
                     help="ranks sharding the model (local processes)")
    _kernel_flags(gen)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_command(sub)
    return parser


def _kernel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", choices=("none", *QUANTIZATIONS), default="none",
                        help="weight-only quantization of the linear layers, made at load (int8: per output channel)")
    parser.add_argument("--kernels", choices=KERNEL_MODES, default=None,
                        help="auto (default, or $PDSERVE_KERNELS): the fastest kernels measured on this host "
                             "(cached); torch: torch's only; native: the native CPU kernels wherever they run")


def _quantization(name: str | None) -> str | None:
    return None if name == "none" else name


def _kernels(args: argparse.Namespace) -> dict[str, str]:
    return {} if args.kernels is None else {"kernels": args.kernels}


def _router_flags(parser: argparse.ArgumentParser) -> None:
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


def resolve_model(name: str) -> str:
    """A preset name becomes its cached folder (written on first use), `smollm2` and a `.gguf` file their
    converted folders (fetched and converted on first use); anything else is a folder path."""
    if name == DEFAULT_MODEL:
        from services.default_model import default_model_folder

        return str(default_model_folder())
    if name.lower().endswith(".gguf"):
        from services.gguf_folder import converted_folder

        return str(converted_folder(name))
    if name in PRESETS:
        from services.model_presets import default_model_dir, ensure_default_model, write_model

        if name == "tiny":
            return str(ensure_default_model())
        folder = default_model_dir().parent / f"{name}-seed0"
        if not (folder / "config.json").exists():
            write_model(name, folder, seed=0)
        return str(folder)
    return name


def serve(args: argparse.Namespace) -> None:
    from router.launcher import ClusterSpec
    from router.launcher import serve as run

    model = resolve_model(args.model)
    options = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                   max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                   kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=args.max_model_len,
                   enable_prefix_caching=not args.no_prefix_caching, quantization=_quantization(args.quantization),
                   **_kernels(args))
    role_options = {role: {"quantization": _quantization(value)} for role, value in
                    (("prefill", args.prefill_quantization), ("decode", args.decode_quantization)) if value is not None}
    spec = ClusterSpec(model=model, mode=args.mode, num_prefill=args.prefill, num_decode=args.decode,
                       num_colocated=args.workers, namespace=args.namespace, prefill_resource=args.prefill_resource,
                       decode_resource=args.decode_resource, prefill_labels=args.prefill_labels,
                       decode_labels=args.decode_labels, engine_options=options, role_engine_options=role_options,
                       pin_cpus=not args.no_pin_cpus,
                       detached=args.detached, max_restarts=args.worker_restarts,
                       gpus_per_worker=args.gpus_per_worker,
                       prefill_tensor_parallel_size=args.prefill_tensor_parallel_size or args.tensor_parallel_size,
                       decode_tensor_parallel_size=args.decode_tensor_parallel_size or args.tensor_parallel_size,
                       peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
                       peak_bytes_per_second=None if args.peak_gbps is None else args.peak_gbps * 1e9)
    address = None if args.address is None else args.address
    run(spec, args.served_model_name or Path(model).name, args.host, args.port, address, **_router_options(args))


def _router_options(args: argparse.Namespace) -> dict:
    return dict(api_key=args.api_key, metrics_without_key=args.metrics_without_key, max_pending=args.max_pending,
                local_prefill_tokens=args.local_prefill_tokens, request_timeout=args.request_timeout)


def router(args: argparse.Namespace) -> None:
    from router.server import attach

    attach(args.address, args.namespace, args.host, args.port, args.model, args.served_model_name, args.wait,
           **_router_options(args))


def scale(args: argparse.Namespace) -> None:
    import ray

    from router.ray_instance import join_cluster
    from router.scaler import scale as run

    wanted = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode)) if n is not None}
    if not wanted:
        raise ValueError("say how many workers: --prefill N and/or --decode M")
    join_cluster(args.address, args.namespace)
    try:
        sizes = {role: n for role, n in (("prefill", args.prefill_tensor_parallel_size),
                                         ("decode", args.decode_tensor_parallel_size)) if n is not None}
        changed = run(args.namespace, wanted, args.drain_timeout, args.startup_timeout, sizes)
    finally:
        ray.shutdown()
    print(f"added {', '.join(changed['added']) or 'none'}; removed {', '.join(changed['removed']) or 'none'}")


def make_model(args: argparse.Namespace) -> None:
    from services.model_presets import write_model

    out = write_model(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote the {args.preset} preset to {out}")


def generate(args: argparse.Namespace) -> None:
    from services import Engine, SamplingParams

    engine = Engine(model=resolve_model(args.model), dtype=args.dtype, quantization=_quantization(args.quantization),
                    tensor_parallel_size=args.tensor_parallel_size, **_kernels(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    try:
        outputs = engine.generate(args.prompt, params)
    finally:
        engine.close()
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(f"--- {prompt!r} -> {len(out.token_ids)} tokens ({out.finish_reason})\n{out.text}")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"--- {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        run = getattr(args, "run", None) or {"serve": serve, "router": router, "scale": scale,
                                              "make-model": make_model, "generate": generate}[args.command]
        run(args)
    except (ValueError, RuntimeError, OSError) as error:  # CheckpointError: ValueError; no Ray cluster: OSError
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
