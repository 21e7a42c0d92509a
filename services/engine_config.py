"""Engine settings, validated on construction (imports no torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.model_config import ModelConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# made at load from any checkpoint (services/quantized_weight.py): weight-only int8 and int4, and
# int8 / int4 weights whose products quantize the activations too (w8a8: per row; w4a8: per 32-column group)
QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8")
KERNEL_MODES = ("auto", "torch", "native")  # how linear/attention kernels are chosen (services/kernels/)


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. `num_kv_blocks=None` sizes the pool from `kv_cache_memory_gb`, capped at
    what `max_num_seqs` sequences of `max_model_len` tokens could ever use."""

    model: str
    dtype: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    seed: int = 0  # seeds the per-request seeds drawn for requests that give none
    quantization: str | None = None  # None, or one of QUANTIZATIONS
    # auto: the fastest kernel measured on this host; torch: torch's only; native: the native ones
    # wherever they can run. $PDSERVE_KERNELS sets the default for every engine of a process tree:
    # the test suite pins "native", so engines compared token by token compute alike.
    kernels: str = field(default_factory=lambda: os.environ.get("PDSERVE_KERNELS", "auto"))
    # Ranks the model is sharded over (Megatron-style, services/tensor_parallel_shards.py); rank 0
    # runs this engine's scheduler, the others follow its step plans.
    tensor_parallel_size: int = 1
    # On CUDA, decode steps of up to this many sequences replay CUDA graphs captured at start (one
    # per bucket: 1, 2, 4, then multiples of 8; services/cuda_graph_runner.py); enforce_eager: never.
    # Steps whose longest context exceeds max_seq_len_to_capture run eagerly too (vLLM's names): a
    # graph's block tables have that width, and the torch decode kernel gathers all of it.
    enforce_eager: bool = False
    max_cudagraph_capture_size: int = 256
    max_seq_len_to_capture: int = 8192
    # Test-only: seconds the engine thread sleeps after each step, so that a test's long request is
    # still running when the test acts on it, however fast the host (tests/cluster_harness.py).
    step_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs (every decode needs one token)")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {self.quantization!r}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        if self.step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {self.step_delay_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        for name in ("max_cudagraph_capture_size", "max_seq_len_to_capture"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")

    def resolve_device(self, cuda_available: bool) -> str:
        if self.device == "auto":
            return "cuda" if cuda_available else "cpu"
        if self.device.startswith("cuda") and not cuda_available:
            raise ValueError(f"device {self.device!r} asked for, but no CUDA device is available")
        return self.device

    def resolve_dtype(self, model: ModelConfig, device_type: str, cpu_has_bf16: bool = False) -> str:
        """"auto" is the checkpoint's own dtype, except on a CPU without native bf16 arithmetic,
        where 16-bit checkpoints run in float32. Measured on an AMX CPU (benchmarks/engine_roofline):
        bf16 matches float32 at batch-1 decode (with the matrix-vector path), prefills 2.5-4.7x
        faster and decodes batch 32 3x faster, so a bf16 checkpoint stays bf16 there."""
        if self.dtype != "auto":
            return self.dtype
        if device_type == "cpu" and (model.torch_dtype == "float16" or not cpu_has_bf16):
            return "float32"  # CPUs lack fast fp16 matmuls; no native bf16 means emulated bf16
        return model.torch_dtype

    def uses_cuda_graphs(self, device_type: str) -> bool:
        """Decode graphs need CUDA, a single engine (a tensor-parallel group's collectives stay
        eager) and not enforce_eager."""
        return device_type == "cuda" and not self.enforce_eager and self.tensor_parallel_size == 1

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        if model.sliding_window is not None:  # attention here is full; stay where that is exact
            limit = min(limit, model.sliding_window)
        if self.max_model_len is None:
            return limit
        if not 1 < self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] for this model, got {self.max_model_len}")
        return self.max_model_len

    def resolve_num_kv_blocks(self, model: ModelConfig, dtype_bytes: int, max_model_len: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        bytes_per_block = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes * self.block_size
        by_memory = int(self.kv_cache_memory_gb * 2**30) // bytes_per_block
        by_need = self.max_num_seqs * -(-max_model_len // self.block_size)
        return max(1, min(by_memory, by_need))


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ValueError, naming the numbers, unless `size` ranks can split this model (Megatron-style:
    heads, intermediate rows and vocab rows evenly; kv heads evenly, or replicated when fewer than ranks)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads")
    k = config.num_kv_heads
    if (k >= size and k % size) or (k < size and size % k):
        problems.append(f"{k} kv heads (needs a multiple of {size}, or a divisor of it to replicate)")
    if config.intermediate_size % size:
        problems.append(f"intermediate size {config.intermediate_size}")
    if config.vocab_size % size:
        problems.append(f"vocab size {config.vocab_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide this model: " + ", ".join(problems))
