"""`pdserve serve`: start (or join) Ray, create the workers, serve the OpenAI API."""

from __future__ import annotations

import argparse
from pathlib import Path

from router import cli_flags
from router import cli_values as flags
from router.cli_flags import DEFAULT_MODEL, MODEL_HELP
from services.engine_config import QUANTIZATIONS
from services.kv_transport_choice import KV_TRANSPORT_MODES


def add_command(sub: argparse._SubParsersAction) -> None:
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
    cli_flags.kernel_flags(serve)
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
    serve.add_argument("--startup-timeout", type=flags.positive_float, default=600.0,
                       help="seconds the workers may take to start: load the model, and on a new host build the "
                            "native kernels and time them (default 600)")
    serve.add_argument("--tensor-parallel-size", type=flags.positive_int, default=1,
                       help="ranks per worker, sharding the model (docs/tensor-parallel.md)")
    serve.add_argument("--prefill-tensor-parallel-size", type=flags.positive_int, default=None,
                       help="ranks per prefill worker (default: --tensor-parallel-size)")
    serve.add_argument("--decode-tensor-parallel-size", type=flags.positive_int, default=None,
                       help="ranks per decode worker (default: --tensor-parallel-size; colocated workers are decode)")
    serve.add_argument("--kv-transport", choices=KV_TRANSPORT_MODES, default="auto",
                       help="how the KV goes from prefill to decode workers: auto (default: the object store, "
                            "until Ray Direct Transport has served on a GPU), object_store, or rdt (Ray Direct "
                            "Transport: CUDA IPC between one host's GPUs, NIXL across hosts or between CPU workers; "
                            "refused at start where it cannot work)")
    cli_flags.router_flags(serve)
    serve.set_defaults(run=serve_cluster)


def serve_cluster(args: argparse.Namespace) -> None:
    from router.cli import resolve_model
    from router.launcher import ClusterSpec
    from router.launcher import serve as run

    model = resolve_model(args.model)
    options = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                   max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                   kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=args.max_model_len,
                   enable_prefix_caching=not args.no_prefix_caching,
                   quantization=cli_flags.quantization(args.quantization),
                   **cli_flags.kernels(args))
    role_options = {role: {"quantization": cli_flags.quantization(value)} for role, value in
                    (("prefill", args.prefill_quantization), ("decode", args.decode_quantization)) if value is not None}
    spec = ClusterSpec(model=model, mode=args.mode, num_prefill=args.prefill, num_decode=args.decode,
                       num_colocated=args.workers, namespace=args.namespace, prefill_resource=args.prefill_resource,
                       decode_resource=args.decode_resource, prefill_labels=args.prefill_labels,
                       decode_labels=args.decode_labels, engine_options=options, role_engine_options=role_options,
                       pin_cpus=not args.no_pin_cpus,
                       detached=args.detached, max_restarts=args.worker_restarts, startup_timeout=args.startup_timeout,
                       gpus_per_worker=args.gpus_per_worker, kv_transport=args.kv_transport,
                       prefill_tensor_parallel_size=args.prefill_tensor_parallel_size or args.tensor_parallel_size,
                       decode_tensor_parallel_size=args.decode_tensor_parallel_size or args.tensor_parallel_size,
                       peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
                       peak_bytes_per_second=None if args.peak_gbps is None else args.peak_gbps * 1e9)
    run(spec, args.served_model_name or Path(model).name, args.host, args.port, args.address,
        **cli_flags.router_options(args))
