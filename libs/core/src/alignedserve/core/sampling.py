"""Per-request sampling parameters: how a request picks its tokens and when it stops.

Pure: the gateway validates and converts them without torch; the engine's sampler
(`alignedserve.engine.sampling`) and stop rules (`alignedserve.core.stopping`) read them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (stop rules: `alignedserve.core.stopping`).

    temperature 0 means greedy; top_k 0 and top_p 1.0 mean off. `logprobs`: None for none, n >= 0 for
    the chosen token's log-probability plus the n most likely alternatives (of the raw model
    distribution, before temperature and masks).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token after the first: its logprob + the top n
    # OpenAI / vLLM penalties (`alignedserve.engine.penalties`): neutral at these defaults.
    presence_penalty: float = 0.0  # subtracted from tokens the output already holds
    frequency_penalty: float = 0.0  # times how often the output holds the token
    repetition_penalty: float = 1.0  # tokens of prompt or output: positive logits / p, negative * p
    min_p: float = 0.0  # sampled rows: drop tokens below min_p x the top token's probability
    min_tokens: int = 0  # no eos / stop token / stop string before this many output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON bodies) but keep the frozen object hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the bad field; return self so calls can chain."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be None or in [0, 20], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(t < 0 or not (-100.0 <= b <= 100.0) for t, b in self.logit_bias):
            raise ValueError(
                f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {self.logit_bias}"
            )
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        return self

    def ending_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Token ids that end this request: its stop_token_ids, and eos unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    @property
    def adjusts_logits(self) -> bool:
        """Whether this request's logits are adjusted before picking (penalties, min_tokens, bias)."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )
