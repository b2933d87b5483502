"""The OpenAI API's request bodies (pydantic), with the sampling fields vLLM accepts
beside OpenAI's, and their translation to `SamplingParams`.

Fields a client may send but this server does not implement (`logit_bias`, `best_of`
above n, `suffix`, tools) are refused with a 400 naming them rather than ignored.
Unknown fields are ignored, as OpenAI's server does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedmla.engine.sampling_params import SamplingParams

# OpenAI allows up to 20 top logprobs per token (chat); completions' `logprobs` up to 5,
# vLLM up to 20: the larger.
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int = Field(default=-1, ge=-1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop_token_ids: list[int] | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None."""
        if self.logit_bias:
            return "logit_bias"
        if self.top_k == 0:
            return "top_k"  # vLLM reads 0 as disabled; SamplingParams takes -1 for that
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams, with its max_tokens resolved by the caller."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop or None,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs, seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return super().unsupported()

    @property
    def token_budget(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token for SamplingParams (None: none asked for)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
