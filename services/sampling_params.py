"""Per-request sampling settings, validated on construction (imports no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how. Field names and defaults follow vLLM's `SamplingParams`.

    `temperature == 0` is greedy. `top_k` of 0 or -1 means off. `seed=None` lets the engine draw
    one; either way sampling is a pure function of (seed, position, logits), so a request resumed
    on another worker continues identically. `logprobs=k` returns the chosen token's logprob plus
    the k most likely alternatives (k=0: the chosen token only). `prompt_logprobs=k` does the same
    for every prompt token after the first (each given the tokens before it); such a prompt is
    computed in full, not served from the prefix cache.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be between 0 and max_tokens")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be finite and >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (off) or a positive count")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if any(s == "" for s in self.stop):
            raise bad("stop", "must not contain an empty string")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be >= 0")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", "must be in [0, 2**63)")
        if any(not math.isfinite(v) for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be finite")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
