"""The one retry mechanism (alignedserve.core.retry over tenacity): schedule, limits, what is retried."""

from __future__ import annotations

import asyncio

import pytest

from alignedserve.core.retry import (
    Backoff,
    RetryCallState,
    retry_error,
    retry_wait_s,
    retrying,
    retrying_sync,
)


class Flaky:
    def __init__(self, failures: int, error: type[Exception] = OSError) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"try {self.calls}")
        return "ok"


def test_backoff_doubles_to_its_cap() -> None:
    backoff = Backoff(0.1, max_s=0.5)
    assert [backoff.delay_s(n) for n in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert Backoff(0.05, factor=1.0).delay_s(7) == 0.05
    with pytest.raises(ValueError):
        Backoff(0.1, attempts=0)


async def test_sleeps_follow_the_backoff_and_hooks_see_each_failure() -> None:
    waits: list[float] = []
    failed: list[str] = []

    def before_sleep(state: RetryCallState) -> None:
        waits.append(retry_wait_s(state))

    def after(state: RetryCallState) -> None:
        failed.append(str(retry_error(state)))

    flaky = Flaky(3)
    runner = retrying(Backoff(0.001, max_s=0.003), on=OSError, after=after, before_sleep=before_sleep)
    async for attempt in runner:
        with attempt:
            result = flaky()
    assert result == "ok" and flaky.calls == 4
    assert waits == pytest.approx([0.001, 0.002, 0.003])
    assert failed == ["try 1", "try 2", "try 3"]


async def test_the_last_error_is_reraised_as_it_was_after_the_attempts() -> None:
    flaky = Flaky(10)
    with pytest.raises(OSError, match="try 3"):
        async for attempt in retrying(Backoff(0.0, attempts=3), on=OSError):
            with attempt:
                flaky()
    assert flaky.calls == 3


async def test_other_errors_and_cancellation_are_not_retried() -> None:
    flaky = Flaky(1, error=KeyError)
    with pytest.raises(KeyError):
        async for attempt in retrying(Backoff(0.0), on=OSError):
            with attempt:
                flaky()
    assert flaky.calls == 1

    calls = 0

    async def cancelled() -> None:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        async for attempt in retrying(Backoff(0.0)):
            with attempt:
                await cancelled()
    assert calls == 1


async def test_give_up_ends_an_unbounded_retry() -> None:
    flaky = Flaky(100)
    with pytest.raises(OSError):
        async for attempt in retrying(Backoff(0.0), on=OSError, give_up=lambda: flaky.calls >= 5):
            with attempt:
                flaky()
    assert flaky.calls == 5


def test_sync_runner_polls_until_the_deadline() -> None:
    flaky = Flaky(1000)
    with pytest.raises(OSError):
        for attempt in retrying_sync(Backoff(0.01, factor=1.0), on=OSError, deadline_s=0.05):
            with attempt:
                flaky()
    assert 2 <= flaky.calls <= 10
