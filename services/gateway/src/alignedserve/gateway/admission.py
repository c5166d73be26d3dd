"""Admission control: how much work the gateway lets into the stack at once.

Two bounds, both answered with 429 + Retry-After (an overloaded gateway says "later", never a 5xx):
- requests: at most `max_inflight` admitted choices;
- tokens: at most a budget of queued tokens, each admitted choice counting its prompt plus its output
  limit (the KV it may come to hold). The budget is `--max-queued-tokens` when given, else derived from
  the KV capacity the backend reports (decode blocks of the live workers or of the engine), else
  `max_inflight x max_model_len / 4` while no capacity is known yet.
Beside them, the host KV pool's own fullness: while the live kvpools hold `POOL_HIGH_WATER` of their
budget, a new choice is refused too (a request admitted then would only wait for pool space, or push the
pool into evicting). A lone request is always admitted when nothing else is: the context checks already
bound it, and refusing it could never succeed on retry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Gauge

from alignedserve.gateway.errors import APIError
from alignedserve.service.drain import Drain

# With no capacity known, budget for a quarter of the context per admitted slot: most prompts and outputs
# are far shorter than the context, so the request bound is still the one that usually binds.
FALLBACK_CONTEXT_SHARE = 4
# Pool usage at which new work waits: the pool needs some room for the requests already admitted.
POOL_HIGH_WATER = 0.95


class TokenBudget(Protocol):
    def limit(self) -> int:
        """Queued tokens allowed now."""
        ...


@dataclass(frozen=True, slots=True)
class FixedTokenBudget:
    """`--max-queued-tokens`: the operator's number."""

    tokens: int

    def limit(self) -> int:
        return self.tokens


@dataclass(frozen=True, slots=True)
class CapacityTokenBudget:
    """The KV capacity behind the gateway, in tokens (`capacity()` is 0 while unknown: then `fallback`)."""

    capacity: Callable[[], int]
    fallback: int

    def limit(self) -> int:
        return self.capacity() or self.fallback


def token_budget(
    max_queued_tokens: int | None,
    capacity: Callable[[], int] | None,
    max_inflight: int,
    max_model_len: int,
) -> TokenBudget:
    if max_queued_tokens is not None:
        return FixedTokenBudget(max_queued_tokens)
    fallback = max(1, max_inflight * max_model_len // FALLBACK_CONTEXT_SHARE)
    return CapacityTokenBudget(capacity or (lambda: 0), fallback)


class Admission:
    """Admitted choices and their queued tokens; each is also counted by the drain so SIGTERM waits."""

    def __init__(
        self,
        limit: int,
        retry_after_s: int,
        drain: Drain,
        gauge: Gauge,
        budget: TokenBudget | None = None,
        pool_usage: Callable[[], float] | None = None,
    ) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.budget = budget
        self._pool_usage = pool_usage
        self.in_flight = 0
        self.queued_tokens = 0
        self._drain = drain
        self._gauge = gauge

    def admit(self, tokens: int = 0) -> Callable[[], None]:
        """Take a slot for a choice of `tokens` queued tokens (429 when either bound is reached);
        returns the release callback (idempotent)."""
        if self.in_flight >= self.limit:
            raise self._refusal(f"The server is at its limit of {self.limit} requests in flight.")
        token_limit = self.budget.limit() if self.budget is not None else None
        if token_limit is not None and self.in_flight and self.queued_tokens + tokens > token_limit:
            raise self._refusal(f"The server is at its limit of {token_limit} queued tokens.")
        pool = self._pool_usage() if self._pool_usage is not None and self.in_flight else 0.0
        if pool >= POOL_HIGH_WATER:
            raise self._refusal(f"The KV pool is full ({pool:.0%} used).")
        self._change(+1, tokens)
        self._drain.enter()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._change(-1, -tokens)
                self._drain.leave()

        return release

    def refuse_busy(self, what: str) -> APIError:
        """A 429 for a resource behind admission that stayed busy (e.g. the bus connections)."""
        return self._refusal(f"The server is busy: {what}.")

    def _refusal(self, why: str) -> APIError:
        retry = str(self.retry_after_s)
        return APIError(
            429,
            f"{why} Retry after {retry} s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": retry},
        )

    def _change(self, requests: int, tokens: int) -> None:
        self.in_flight += requests
        self.queued_tokens += tokens
        self._gauge.set(self.in_flight)
