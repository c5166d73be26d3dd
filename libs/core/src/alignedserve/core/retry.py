"""The one retry mechanism of the tree: a `Backoff` policy (pure data) run by tenacity.

Every retry loop (bus handler tries and consumer reconnects, UCX transfer attempts, the prefill's push to
a full pool, the decode's ordered publishes, waiting for a broker or a server) builds its runner here:

    async for attempt in retrying(Backoff(0.05, max_s=2.0, attempts=3), on=OSError):
        with attempt:
            await try_it()

An exception of an `on` type is retried after the back-off; any other one (CancelledError included)
leaves at once. When the tries run out, the last exception is re-raised as it was (not wrapped).
Tenacity imports asyncio only when the async runner sleeps, so this module stays importable by the pure
cores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    wait_exponential,
)

__all__ = ["Backoff", "RetryCallState", "retry_error", "retry_wait_s", "retrying", "retrying_sync"]

Errors = type[BaseException] | tuple[type[BaseException], ...]
Hook = Callable[[RetryCallState], object]


@dataclass(frozen=True, slots=True)
class Backoff:
    """`first_s` before the second try, times `factor` before each next one (1.0: a fixed poll), at most
    `max_s`; `attempts` tries in all (None: no limit)."""

    first_s: float
    max_s: float = math.inf
    attempts: int | None = None
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"a back-off needs at least one attempt, got {self.attempts}")
        if self.first_s < 0 or self.max_s < 0 or self.factor < 1:
            raise ValueError(f"back-off delays must be >= 0 and factor >= 1: {self}")

    def delay_s(self, failed: int) -> float:
        """Seconds waited after the `failed`-th failed try (1-based)."""
        return float(min(self.max_s, self.first_s * self.factor ** (failed - 1)))


def _options(
    backoff: Backoff,
    on: Errors,
    give_up: Callable[[], bool] | None,
    deadline_s: float | None,
    after: Hook | None,
    before_sleep: Hook | None,
) -> dict[str, Any]:
    stop: Any = stop_never if backoff.attempts is None else stop_after_attempt(backoff.attempts)
    if deadline_s is not None:
        stop = stop | stop_after_delay(deadline_s)
    if give_up is not None:
        stop = stop | (lambda _state: give_up())
    wait = wait_exponential(multiplier=backoff.first_s, max=backoff.max_s, exp_base=backoff.factor)
    options: dict[str, Any] = {
        "stop": stop,
        "wait": wait,
        "retry": retry_if_exception_type(on),
        "reraise": True,
    }
    if after is not None:
        options["after"] = after
    if before_sleep is not None:
        options["before_sleep"] = before_sleep
    return options


def retrying(
    backoff: Backoff,
    *,
    on: Errors = Exception,
    give_up: Callable[[], bool] | None = None,
    deadline_s: float | None = None,
    after: Hook | None = None,
    before_sleep: Hook | None = None,
) -> AsyncRetrying:
    """An async runner: `async for attempt in retrying(...): with attempt: ...`.

    give_up: asked after each failed try; True re-raises its error instead of retrying.
    deadline_s: no retry once this long has passed since the first try began.
    after: called after every failed try that was retryable (the last one included).
    before_sleep: called before each back-off (`retry_wait_s(state)` is its length).
    """
    return AsyncRetrying(**_options(backoff, on, give_up, deadline_s, after, before_sleep))


def retrying_sync(
    backoff: Backoff,
    *,
    on: Errors = Exception,
    give_up: Callable[[], bool] | None = None,
    deadline_s: float | None = None,
    after: Hook | None = None,
    before_sleep: Hook | None = None,
) -> Retrying:
    """`retrying` for blocking code (sleeps with time.sleep): `for attempt in retrying_sync(...)`."""
    return Retrying(**_options(backoff, on, give_up, deadline_s, after, before_sleep))


def retry_error(state: RetryCallState) -> BaseException:
    """The error the failed try raised (for `after` and `before_sleep` hooks)."""
    assert state.outcome is not None and state.outcome.failed
    error = state.outcome.exception()
    assert error is not None
    return error


def retry_wait_s(state: RetryCallState) -> float:
    """The back-off about to be waited (in a `before_sleep` hook)."""
    return state.upcoming_sleep
