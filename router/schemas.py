"""Request bodies of the OpenAI-compatible API, validated with pydantic at the HTTP boundary."""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


class SamplingFields(BaseModel):
    """Fields shared by completions and chat; names and defaults as in OpenAI and vLLM."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # strict: pydantic would read true/false as ids 1/0
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:<id>", never ambiguous
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and any(s == "" for s in ([value] if isinstance(value, str) else value)):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            # ASCII digits only: str.isdigit() also takes "²" and "٣", which int() reads as 3
            if not re.fullmatch("[0-9]+", key) or not math.isfinite(bias):
                raise ValueError("keys must be token ids (non-negative integers) and values finite numbers")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @property
    def stream_flags(self) -> StreamOptions:
        """The stream options in effect (all off when none were given)."""
        return self.stream_options or StreamOptions()

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, seed=self.seed,
            ignore_eos=self.ignore_eos, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


def _prompt_kind(value) -> str:
    """Which of the prompt's four forms `value` is, from its first element: pydantic then validates
    that form only (a plain union tried list[str] on each of 900,000 ids first, ~0.5 s holding the GIL)."""
    if isinstance(value, str):
        return "text"
    first = value[0] if isinstance(value, list) and value else None
    return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"


Prompt = Annotated[Union[Annotated[str, Tag("text")], Annotated[list[str], Tag("texts")],  # noqa: UP007
                         Annotated[list[StrictInt], Tag("ids")], Annotated[list[list[StrictInt]], Tag("id_lists")]],
                   Discriminator(_prompt_kind)]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool = False  # before max_tokens, whose check reads it (fields are validated in this order)
    # 0 only with echo: the prompt scored, nothing generated (how evaluation harnesses and vLLM do it)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_form(cls, value, handler):
        # The form is checked by pydantic's own (compiled) validators, never element by element in
        # Python: a 900,000-id prompt must not hold the router's GIL. Its errors are said in words here
        # (the union's own error for [[false]] would be "Input should be a valid string").
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                             "token ids (token ids are integers; true and false are not)") from None
        nested = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        if prompt == "" or prompt == [] or (nested and any(len(v) == 0 for v in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1, got 0 (0 is allowed only with echo: true, which "
                             "returns the prompt, and with logprobs its logprobs, without generating)")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return value


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text prompt, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]  # strict: pydantic would read true/false as ids 1/0

