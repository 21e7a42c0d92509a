"""The `pdserve` command: serve (the cluster and its router: `serve_command.py`), router (one more
router), scale (the workers), make-model, generate (offline), and the commands of COMMAND_MODULES.

Subcommands import what they need when they run, so this module imports no torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from router import cli_flags, serve_command
from router import cli_values as flags
from router.cli_flags import DEFAULT_MODEL, MODEL_HELP

PRESETS = ("tiny", "small", "1b")

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
    serve_command.add_command(sub)

    router = sub.add_parser("router", help="one more router for workers already running (they are shared by name)")
    router.add_argument("--address", default="auto", help="the Ray cluster (default auto)")
    router.add_argument("--namespace", default="pdserve")
    router.add_argument("--model", default=None, help="the model folder on this host (default: the workers' own)")
    router.add_argument("--wait", type=flags.non_negative_float, default=60.0, help="seconds to wait for a decode worker")
    cli_flags.router_flags(router)

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
    cli_flags.kernel_flags(gen)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_command(sub)
    return parser


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


def router(args: argparse.Namespace) -> None:
    from router.server import attach

    attach(args.address, args.namespace, args.host, args.port, args.model, args.served_model_name, args.wait,
           **cli_flags.router_options(args))


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

    engine = Engine(model=resolve_model(args.model), dtype=args.dtype, quantization=cli_flags.quantization(args.quantization),
                    tensor_parallel_size=args.tensor_parallel_size, **cli_flags.kernels(args))
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
        run = getattr(args, "run", None) or {"router": router, "scale": scale, "make-model": make_model,
                                              "generate": generate}[args.command]
        run(args)
    except (ValueError, RuntimeError, OSError) as error:  # CheckpointError: ValueError; no Ray cluster: OSError
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
