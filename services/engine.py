"""The offline engine: a model, a paged KV pool, a scheduler and the three-call step loop."""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.block_manager import BlockManager
from services.checkpoint import load_weights
from services.device_kv import DeviceKV
from services.engine_config import EngineConfig
from services.kv_payload import KVPayload
from services.model_config import ModelConfig
from services.model_runner import ModelRunner
from services.request_output import RequestOutput, StepOutput
from services.sampling_params import SamplingParams
from services.scheduler import SampledToken, Scheduler, SchedulerConfig
from services.sequence import FinishReason, Sequence
from services.tensor_parallel import GroupSpec
from services.tensor_parallel_runner import TensorParallel
from services.tensor_parallel_shards import shard_weights
from services.text_stream import TextStream
from services.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    """Generate with continuous batching. `Engine(model=PATH, dtype=..., block_size=16, ...)`;
    keyword arguments are the fields of `EngineConfig`."""

    def __init__(self, model: str | Path, *, group_spec: GroupSpec | None = None, rank: int = 0, **options) -> None:
        """`group_spec` and `rank`: this engine is that rank of a tensor-parallel group (a worker's
        rank actor); without them, tensor_parallel_size > 1 starts the other ranks as local processes."""
        self.config = EngineConfig(model=str(model), **options)
        self.num_tokens_processed = 0
        self.model_config = ModelConfig.from_folder(self.config.model)
        self.tokenizer = Tokenizer.from_folder(self.config.model)
        self.device = torch.device(self.config.resolve_device(torch.cuda.is_available()))
        if self.device.type == "cuda" and self.device.index is None:  # name the GPU it runs on ("cuda:0")
            self.device = torch.device("cuda", torch.cuda.current_device())
        cpu_has_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        self.dtype = getattr(torch, self.config.resolve_dtype(self.model_config, self.device.type, cpu_has_bf16))
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.max_model_len = self.config.resolve_max_model_len(self.model_config)
        num_blocks = self.config.resolve_num_kv_blocks(self.model_config, self.dtype.itemsize, self.max_model_len)
        self.tensor_parallel = TensorParallel.start(self.config, self.model_config, self.device, group_spec, rank)
        quantizing = self.config.quantization is not None and self.device.type == "cpu"  # float32 fits: host memory
        weights = load_weights(self.config.model, self.model_config, self.dtype, quantizing)
        if self.tensor_parallel is not None:
            shard_weights(weights, self.model_config, self.tensor_parallel.layout)
        weights = {name: w.to(self.device) for name, w in weights.items()}
        self.runner = ModelRunner(self.model_config, weights, self.dtype, self.device, self.config.block_size,
                                  num_blocks, self.max_model_len, self.config.quantization, self.config.kernels,
                                  self.tensor_parallel)
        log.info("%s", self.runner.model.kernel_summary)
        if self.runner.gpu_decode_attention is not None:
            log.info("decode attention on %s: %s (services/gpu_decode_attention.py)", self.device,
                     self.runner.gpu_decode_attention)
        if self.config.uses_cuda_graphs(self.device.type):
            self.runner.enable_decode_graphs(min(self.config.max_num_seqs, self.config.max_cudagraph_capture_size),
                                             self.config.max_seq_len_to_capture)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len),
            self.block_manager, self.model_config.eos_token_ids)
        self._seed_source = random.Random(self.config.seed)
        self._arrivals = itertools.count()
        # Test-only pacing (EngineConfig.step_delay_s; tests also set it on a running worker), and a
        # gate tests clear to hold a worker's requests in flight (a step waits until it is set again).
        self.step_delay_s = self.config.step_delay_s
        self.step_gate = threading.Event()
        self.step_gate.set()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    export_kv: bool = False, output_token_ids: list[int] = ()) -> list[int]:
        """Queue a request; returns its prompt token ids. Text is tokenized (with BOS); token ids
        are used exactly as given. With `export_kv`, the step that finishes the prompt also returns
        its KV (prefill side). `output_token_ids` resumes a request that already produced those
        tokens elsewhere: they are computed with the prompt and count as output (for max_tokens,
        min_tokens and penalties), so with the same seed it continues exactly as it would have."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_length(token_ids, params)
        outputs = [int(t) for t in output_token_ids]
        if len(outputs) >= params.max_tokens:
            raise ValueError(f"a resumed request has {len(outputs)} of its max_tokens={params.max_tokens} already")
        self._check_vocab(outputs)
        seq = self._sequence(request_id, token_ids + outputs, len(token_ids), params)
        seq.export_kv = export_kv
        self.scheduler.add(seq)
        return token_ids  # the sequence holds its own list, which grows with the output

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first: SampledToken,
                      params: SamplingParams, kv: KVPayload | DeviceKV, kv_check: Future | None = None) -> None:
        """Queue a request whose prompt was prefilled elsewhere: `kv` holds the prompt's KV and
        `first` the token sampled from it. It joins the running batch once blocks are free.

        The checksum is verified here, before queueing, unless the caller already started
        `verify_kv(kv)` on another thread and passes its Future as `kv_check`: then the KV is
        copied into the pool while the check runs, and the step that copied it waits for the
        result before reporting anything; a failed check ends only this request, with the error."""
        self._check_length(prompt_token_ids, params)
        if kv.num_tokens != len(prompt_token_ids):
            raise ValueError(f"KV covers {kv.num_tokens} tokens but the prompt has {len(prompt_token_ids)}")
        if kv_check is None:  # checked here, so a corrupt payload fails only its own request
            self.verify_kv(kv)
        else:  # the layout at least, now: a copy must never start from a payload of another shape
            c = self.model_config
            kv.check_layout(c.num_layers, c.num_kv_heads, c.head_dim, str(self.dtype).removeprefix("torch."))
        seq = self._sequence(request_id, list(prompt_token_ids) + [first.token_id], len(prompt_token_ids), params)
        if first.logprobs is not None:
            seq.output_logprobs.append(first.logprobs)
        seq.kv_payload = kv
        seq.kv_check = kv_check
        self.scheduler.add(seq)

    def verify_kv(self, kv: KVPayload | DeviceKV) -> None:
        """Raise KVTransferError unless `kv` fits this engine's pool and its checksum holds.
        Reads only configuration, so it may run on any thread."""
        c = self.model_config
        kv.verify(c.num_layers, c.num_kv_heads, c.head_dim, str(self.dtype).removeprefix("torch."))

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do for a single one)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    def _sequence(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                  params: SamplingParams) -> Sequence:
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        return Sequence(request_id, token_ids, num_prompt_tokens, params, seed, next(self._arrivals))

    def _check_length(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens, "
                             f"but the prompt has {len(token_ids)} tokens")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                             f"({len(token_ids)}) plus max_tokens ({params.max_tokens}) exceeds it")
        self._check_vocab(token_ids)

    def _check_vocab(self, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One engine iteration: schedule, run, update."""
        self.step_gate.wait()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        sampled, exported, prompt_logprobs = self.runner.run(batch)
        failed = self._failed_kv_checks(batch.kv_imports)
        self.num_tokens_processed += sum(batch.num_new_tokens)
        touched = self.scheduler.update(batch, sampled, prompt_logprobs)
        outputs = [self._step_output(seq, exported.get(seq.request_id)) for seq in touched
                   if seq.request_id not in failed]
        for request_id, error in failed.items():
            self.scheduler.abort(request_id)
            outputs.append(StepOutput(request_id, [], None, FinishReason.ABORT.value, 0, 0, error=error))
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return outputs

    def _failed_kv_checks(self, imported: list[Sequence]) -> dict[str, BaseException]:
        """Wait for the checksum passes of the KV this step imported (each usually done: it ran
        while the KV was copied); the requests whose check failed, with its error."""
        failed = {}
        for seq in imported:
            if seq.kv_check is not None:
                error, seq.kv_check = seq.kv_check.exception(), None
                if error is not None:
                    failed[seq.request_id] = error
        return failed

    def _step_output(self, seq: Sequence, kv: KVPayload | None) -> StepOutput:
        # A prefilled sequence's first token was sampled (and reported) by the prefill side.
        logprobs = seq.output_logprobs[-1:] if seq.params.logprobs is not None else None
        reason = seq.finish_reason.value if seq.finish_reason else None
        with_prompt = seq.params.prompt_logprobs is not None and seq.num_output_tokens == 1
        return StepOutput(seq.request_id, [seq.token_ids[-1]], logprobs, reason, seq.num_prompt_tokens,
                          seq.num_cached_tokens, kv, prompt_logprobs=seq.prompt_logprobs if with_prompt else None)

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; results in prompt order, with stop strings applied."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        base = next(self._arrivals)
        results: dict[str, _Collected] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            request_id = f"generate-{base}-{i}"
            prompt_ids = self.add_request(request_id, prompt, p)
            results[request_id] = _Collected(request_id, prompt_ids, p, TextStream(self.tokenizer, prompt_ids, p))
        while self.has_unfinished_requests:
            for out in self.step():
                result = results.get(out.request_id)
                if result is not None and result.add(out):
                    self.scheduler.abort(out.request_id, FinishReason.STOP)
        return [r.output() for r in results.values()]


@dataclass(slots=True)
class _Collected:
    """One `generate` request's tokens and text as its step outputs arrive."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float]] | None = None

    def add(self, out: StepOutput) -> bool:
        """Add one step's output; True when a stop string ends the request before the engine does."""
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text.feed(out.new_token_ids, out.finish_reason is not None)
        self.token_ids += out.new_token_ids[: self.text.consumed]
        self.logprobs += (out.new_logprobs or [])[: self.text.consumed]
        self.finish_reason = "stop" if self.text.stopped else out.finish_reason
        return self.text.stopped and out.finish_reason is None

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_token_ids, self.token_ids, self.text.text,
                             self.finish_reason, self.logprobs if self.params.logprobs is not None else None,
                             self.num_cached_tokens, prompt_logprobs=self.prompt_logprobs)
