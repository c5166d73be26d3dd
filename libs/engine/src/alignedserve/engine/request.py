"""Engine-side request state, what each step returns, and the errors `add_request` raises."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from alignedserve.core.sampling import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take; the message says why and what to change."""


class PromptTooLongError(RequestError):
    pass


class KvBudgetError(RequestError):
    pass


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # needs (more) prefill
    RUNNING = "running"  # decoding
    PARKED = "parked"  # prefill-only: first token sampled, KV held until exported and freed


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[TokenLogprob] | None  # one per output token, when the request asked for them
    # One per prompt token after the first (its logprob given the tokens before it), when the request
    # asked for them; only in the output of the step that finished the prompt's prefill, and the last.
    prompt_logprobs: list[TokenLogprob] | None = None


class StopRule(Protocol):
    def check(self, output_token_ids: Sequence[int]) -> str | None: ...


class TokenStopRule:
    """Stop on eos / stop token ids / max_tokens, without detokenizing (requests with no stop strings)."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        self._max_tokens = params.max_tokens
        self._min_tokens = params.min_tokens
        self._stop_ids = params.ending_token_ids(eos_token_ids)

    def check(self, output_token_ids: Sequence[int]) -> str | None:
        may_stop = len(output_token_ids) >= self._min_tokens
        if may_stop and output_token_ids and output_token_ids[-1] in self._stop_ids:
            return "stop"
        return "length" if len(output_token_ids) >= self._max_tokens else None


@dataclass(eq=False)
class Request:
    serial: int  # unique among the requests an engine ever admits (a re-admitted request gets a new one)
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_rule: StopRule
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of all_token_ids whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    park_after_prefill: bool = False
    overtaken_tokens: int = 0  # prompt tokens prefilled for other requests while it waited with some left
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def prompt_targets(self, start: int, end: int) -> list[int]:
        """The prompt tokens that positions [start, end) predict (position p predicts token p + 1)."""
        return self.prompt_token_ids[start + 1 : min(end + 1, len(self.prompt_token_ids))]

    def output(self, new_tokens: int, with_prompt_logprobs: bool = False) -> RequestOutput:
        prompt_logprobs = self.prompt_logprobs if with_prompt_logprobs else None
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.output_token_ids[len(self.output_token_ids) - new_tokens :]
            if new_tokens
            else [],
            output_token_ids=list(self.output_token_ids),
            finished=self.finish_reason is not None,
            finish_reason=self.finish_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
        )
