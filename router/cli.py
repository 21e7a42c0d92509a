"""The `pdserve` command: make-model and generate (offline).

Subcommands import what they need when they run, so this module imports no torch.
"""

from __future__ import annotations

import argparse
import sys
import time

PRESETS = ("tiny", "small", "1b")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="write a Hugging Face model folder with deterministic random weights")
    make.add_argument("--preset", choices=PRESETS, required=True)
    make.add_argument("--out", required=True, help="folder to create")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="weight dtype on disk (default: the preset's)")

    gen = sub.add_parser("generate", help="generate offline with the engine (no Ray, no HTTP)")
    gen.add_argument("--model", default="tiny", help="a model folder, or a preset name (generated on first use)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    gen.add_argument("--max-tokens", type=_positive_int, default=32)
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    return parser


def resolve_model(name: str) -> str:
    """A preset name becomes its cached folder (written on first use); anything else is a path."""
    if name in PRESETS:
        from services.model_presets import default_model_dir, ensure_default_model, write_model

        if name == "tiny":
            return str(ensure_default_model())
        folder = default_model_dir().parent / f"{name}-seed0"
        if not (folder / "config.json").exists():
            write_model(name, folder, seed=0)
        return str(folder)
    return name


def make_model(args: argparse.Namespace) -> None:
    from services.model_presets import write_model

    out = write_model(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote the {args.preset} preset to {out}")


def generate(args: argparse.Namespace) -> None:
    from services import Engine, SamplingParams

    engine = Engine(model=resolve_model(args.model), dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    outputs = engine.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(f"--- {prompt!r} -> {len(out.token_ids)} tokens ({out.finish_reason})\n{out.text}")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"--- {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        {"make-model": make_model, "generate": generate}[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError) as error:  # CheckpointError is a ValueError
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
