"""OpenAI-compatible request and response bodies for /v1/completions and /v1/chat/completions.

Requests are strict: an unknown field is a 400 naming it, and a known OpenAI/vLLM parameter this server
does not implement is accepted only at its neutral value (e.g. `presence_penalty: 0`), so a client never
gets silently different sampling from what it asked for. Cross-field checks that need the tokenizer or
the context length (prompt too long, max_tokens) happen in `requests.py`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_LOGPROBS = 20  # the engine returns at most this many alternatives per token
MAX_N = 64  # choices per prompt (OpenAI allows 128; each choice is a sequence in flight here)
MAX_PROMPTS = 64  # prompts in one /v1/completions batch


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False  # one extra chunk before [DONE] with the request's usage
    continuous_usage_stats: bool = False  # usage (so far) in every chunk


# Parameters we accept only at the value that means "off"; anything else is a 400 naming the field.
_NEUTRAL_VALUES: dict[str, Any] = {
    "best_of": None,
    "suffix": None,
    "tools": None,
}


class ParamError(ValueError):
    """A request parameter is invalid; `param` names it for the OpenAI error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingFields(StrictModel):
    """Fields shared by both endpoints (OpenAI names, plus vLLM's top_k, stop_token_ids, ignore_eos)."""

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM uses -1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = None  # accepted for OpenAI compatibility; logged with the request
    request_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt, each sampled on its own
    best_of: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # vLLM's; 1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's
    min_tokens: int = Field(0, ge=0)  # vLLM's: no eos / stop before this many tokens
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        for name, neutral in _NEUTRAL_VALUES.items():
            if name in type(self).model_fields and not _is_neutral(getattr(self, name), neutral):
                raise ParamError(name, f"{name}={getattr(self, name)!r} is not supported (only {neutral!r})")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream=true")
        stops = self.stop_strings
        if any(s == "" for s in stops):
            raise ParamError("stop", "stop strings must be non-empty")
        if len(stops) > 16:
            raise ParamError("stop", f"at most 16 stop strings, got {len(stops)}")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise ParamError("stop_token_ids", "stop_token_ids must be non-negative token ids")
        self.logit_bias_pairs()  # raises on a bad key or bias
        return self

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; a key that is not a token id or a bias outside
        [-100, 100] is a ParamError."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def _is_neutral(value: Any, neutral: Any) -> bool:
    if value is None or value == neutral:
        return True
    return neutral is None and value in ({}, [], "")


# --- /v1/completions -------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    # A string, a list of token ids, or a batch of either (one choice, or n, per prompt).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt back, scored
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens=0 needs echo=true (it returns the prompt alone)")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) == 0:
                raise ParamError("prompt", "prompt must not be empty")
            if isinstance(prompt[0], str | list) and len(prompt) > MAX_PROMPTS:
                raise ParamError("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, as text or token ids, in order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], str | list):
            return [p if isinstance(p, str) else list(p) for p in prompt if isinstance(p, str | list)]
        return [[int(t) for t in prompt if isinstance(t, int)]]


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended the output


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions --------------------------------------------------------------------------


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(StrictModel):
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM: end the prompt with the assistant turn's header
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs=true")
        if self.tool_choice not in (None, "none"):
            raise ParamError(
                "tool_choice", f"tool_choice={self.tool_choice!r} is not supported (tools are not)"
            )
        return self

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(ResponseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(ResponseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- /v1/models and errors -------------------------------------------------------------------------


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "alignedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
