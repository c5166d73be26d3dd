"""The consume-side core shared by both buses: bounded de-dup, retries, dead-lettering."""

from __future__ import annotations

import pytest

from alignedserve.bus.base import ConsumerOptions, Delivery, Dispatcher, SeenIds
from alignedserve.bus.messages import Cancel, Message, encode


def test_seen_ids_forget_the_oldest_past_capacity() -> None:
    seen = SeenIds(3)
    for i in range(5):
        seen.add(f"m{i}")
    assert len(seen) == 3
    assert "m0" not in seen and "m1" not in seen and "m4" in seen
    seen.add("m2")  # refreshed: now the newest
    seen.add("m5")
    assert "m2" in seen and "m3" not in seen


def test_seen_ids_capacity_zero_remembers_nothing() -> None:
    seen = SeenIds(0)
    seen.add("m")
    assert "m" not in seen and len(seen) == 0
    with pytest.raises(ValueError):
        SeenIds(-1)


class Recorder:
    def __init__(self, failures: int = 0) -> None:
        self.handled: list[str] = []
        self.failures = failures
        self.dead: list[tuple[str, bytes, str]] = []

    async def handler(self, message: Message, delivery: Delivery) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("transient")
        self.handled.append(message.message_id)

    async def dead_letter(self, topic: str, payload: bytes, error: str) -> None:
        self.dead.append((topic, payload, error))


def make(rec: Recorder, **options: object) -> Dispatcher:
    opts = ConsumerOptions(retry_backoff_s=0.0, **options)  # type: ignore[arg-type]
    return Dispatcher(rec.handler, opts, rec.dead_letter, "test")


DELIVERY = Delivery("t", "1-0", redelivered=False)


async def test_redelivered_message_is_handled_once() -> None:
    rec = Recorder()
    d = make(rec)
    payload = encode(Cancel(request_id="r"))
    for _ in range(3):
        await d.dispatch(payload, DELIVERY, lambda: 0.0)
    assert len(rec.handled) == 1
    assert (d.stats.delivered, d.stats.handled, d.stats.duplicates) == (3, 1, 2)


async def test_transient_failure_is_retried() -> None:
    rec = Recorder(failures=2)
    d = make(rec, max_attempts=3)
    await d.dispatch(encode(Cancel(request_id="r")), DELIVERY, lambda: 0.0)
    assert len(rec.handled) == 1 and rec.dead == []


async def test_persistent_failure_is_dead_lettered_and_can_be_retried_later() -> None:
    rec = Recorder(failures=10)
    d = make(rec, max_attempts=2)
    payload = encode(Cancel(request_id="r"))
    await d.dispatch(payload, DELIVERY, lambda: 0.0)
    assert rec.handled == [] and rec.dead == [("t", payload, "RuntimeError('transient')")]
    assert d.stats.dead_lettered == 1
    rec.failures = 0
    await d.dispatch(payload, DELIVERY, lambda: 0.0)  # not marked seen: a replay is handled
    assert len(rec.handled) == 1


async def test_undecodable_payload_is_dead_lettered() -> None:
    rec = Recorder()
    d = make(rec)
    await d.dispatch(b"\x93\xa4nope\x01\x90", DELIVERY, lambda: 0.0)
    assert rec.handled == [] and "unknown control message type 'nope'" in rec.dead[0][2]


async def test_lag_is_measured_from_created_at() -> None:
    rec = Recorder()
    d = make(rec)
    await d.dispatch(encode(Cancel(request_id="r", created_at=10.0)), DELIVERY, lambda: 10.25)
    assert d.stats.lag_s == [0.25]
