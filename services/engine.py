"""The offline engine: a model, a paged KV pool, a scheduler and the three-call step loop."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import torch

from services.block_manager import BlockManager
from services.checkpoint import load_weights
from services.detokenizer import IncrementalDetokenizer
from services.engine_config import EngineConfig
from services.kv_payload import KVPayload
from services.model_config import ModelConfig
from services.model_runner import ModelRunner
from services.request_output import RequestOutput, StepOutput
from services.sampling_params import SamplingParams
from services.scheduler import SampledToken, Scheduler, SchedulerConfig
from services.sequence import FinishReason, Sequence
from services.stop_checker import StopChecker
from services.tokenizer import Tokenizer


class Engine:
    """Generate with continuous batching. `Engine(model=PATH, dtype=..., block_size=16, ...)`;
    keyword arguments are the fields of `EngineConfig`."""

    def __init__(self, model: str | Path, **options) -> None:
        self.config = EngineConfig(model=str(model), **options)
        self.num_tokens_processed = 0
        self.model_config = ModelConfig.from_folder(self.config.model)
        self.tokenizer = Tokenizer.from_folder(self.config.model)
        self.device = torch.device(self.config.resolve_device(torch.cuda.is_available()))
        self.dtype = getattr(torch, self.config.resolve_dtype(self.model_config, self.device.type))
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.max_model_len = self.config.resolve_max_model_len(self.model_config)
        num_blocks = self.config.resolve_num_kv_blocks(self.model_config, self.dtype.itemsize, self.max_model_len)
        weights = {name: w.to(self.device) for name, w in
                   load_weights(self.config.model, self.model_config, self.dtype).items()}
        self.runner = ModelRunner(self.model_config, weights, self.dtype, self.device, self.config.block_size,
                                  num_blocks, self.max_model_len)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len),
            self.block_manager, self.model_config.eos_token_ids)
        self._seed_source = random.Random(self.config.seed)
        self._arrivals = itertools.count()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    export_kv: bool = False) -> None:
        """Queue a request. Text is tokenized (with BOS); token ids are used exactly as given.
        With `export_kv`, the step that finishes the prompt also returns its KV (prefill side)."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_length(token_ids, params)
        seq = self._sequence(request_id, token_ids, params)
        seq.export_kv = export_kv
        self.scheduler.add(seq)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first: SampledToken,
                      params: SamplingParams, kv: KVPayload) -> None:
        """Queue a request whose prompt was prefilled elsewhere: `kv` holds the prompt's KV and
        `first` the token sampled from it. It joins the running batch once blocks are free."""
        self._check_length(prompt_token_ids, params)
        if kv.num_tokens != len(prompt_token_ids):
            raise ValueError(f"KV covers {kv.num_tokens} tokens but the prompt has {len(prompt_token_ids)}")
        c = self.model_config  # checked here, so a corrupt payload fails only its own request
        kv.verify(c.num_layers, c.num_kv_heads, c.head_dim, str(self.dtype).removeprefix("torch."))
        seq = self._sequence(request_id, list(prompt_token_ids) + [first.token_id], params)
        seq.num_prompt_tokens = len(prompt_token_ids)
        if first.logprobs is not None:
            seq.output_logprobs.append(first.logprobs)
        seq.kv_payload = kv
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    def _sequence(self, request_id: str, token_ids: list[int], params: SamplingParams) -> Sequence:
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        return Sequence(request_id, token_ids, len(token_ids), params, seed, next(self._arrivals))

    def _check_length(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens, "
                             f"but the prompt has {len(token_ids)} tokens")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                             f"({len(token_ids)}) plus max_tokens ({params.max_tokens}) exceeds it")
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One engine iteration: schedule, run, update."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        sampled, exported = self.runner.run(batch)
        self.num_tokens_processed += sum(batch.num_new_tokens)
        touched = self.scheduler.update(batch, sampled)
        return [self._step_output(seq, exported.get(seq.request_id)) for seq in touched]

    def _step_output(self, seq: Sequence, kv: KVPayload | None) -> StepOutput:
        # A prefilled sequence's first token was sampled (and reported) by the prefill side.
        logprobs = seq.output_logprobs[-1:] if seq.params.logprobs is not None else None
        reason = seq.finish_reason.value if seq.finish_reason else None
        return StepOutput(seq.request_id, [seq.token_ids[-1]], logprobs, reason, seq.num_prompt_tokens,
                          seq.num_cached_tokens, kv)

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; results in prompt order, with stop strings applied."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        base = next(self._arrivals)
        states: dict[str, _TextState] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            request_id = f"generate-{base}-{i}"
            self.add_request(request_id, prompt, p)
            seq = self.scheduler.waiting[-1]
            states[request_id] = _TextState(self.tokenizer, seq, p)
        while self.has_unfinished_requests:
            for out in self.step():
                state = states.get(out.request_id)
                if state is not None and state.consume(out):
                    self.scheduler.abort(out.request_id, FinishReason.STOP)
        return [state.result() for state in states.values()]


class _TextState:
    """Detokenizes one request incrementally and applies its stop strings."""

    def __init__(self, tokenizer: Tokenizer, seq: Sequence, params: SamplingParams) -> None:
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.token_ids[:], params.skip_special_tokens)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.stopped_on_string = False

    def consume(self, out: StepOutput) -> bool:
        """Add one step's tokens; True when a stop string ended the request."""
        new_text = self.detokenizer.push(out.new_token_ids)
        if out.finish_reason is not None:
            new_text += self.detokenizer.flush()  # a character cut in half by the end
        emitted, stopped = self.stop_checker.feed(new_text)
        self.text += emitted
        if stopped:
            self.stopped_on_string = True
        elif out.finish_reason is not None:
            self.text += self.stop_checker.flush()
        return stopped and out.finish_reason is None

    def result(self) -> RequestOutput:
        seq = self.seq
        reason = "stop" if self.stopped_on_string else seq.finish_reason.value
        return RequestOutput(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids,
                             self.text, reason, seq.output_logprobs if seq.params.logprobs is not None else None,
                             seq.num_cached_tokens)
