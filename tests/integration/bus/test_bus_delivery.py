"""Publish, consume, ack on each bus through the one interface: groups, fan-out, de-dup, dead letters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bus_helpers import eventually
from raw_access import publish_raw, read_raw

from alignedserve.bus import Bus, Delivery
from alignedserve.bus.messages import (
    Cancel,
    FinishReason,
    Message,
    PrefillRequest,
    SamplingSpec,
    TokenBatch,
    TokenEntry,
)


def prefill(i: int) -> PrefillRequest:
    return PrefillRequest(
        request_id=f"r{i}",
        model="smollm2",
        prompt_token_ids=tuple(range(i, i + 50)),
        sampling=SamplingSpec(max_tokens=8, temperature=0.0),
        arrival=float(i),
        gateway_id="gw-0",
    )


class Collector:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.deliveries: list[Delivery] = []

    async def __call__(self, message: Message, delivery: Delivery) -> None:
        self.messages.append(message)
        self.deliveries.append(delivery)


async def test_publish_consume_ack(bus: Bus, new_topic: Callable[[str], str], cleanup: list[str]) -> None:
    topic = new_topic("work")
    cleanup.append(topic)
    sent: list[Message] = [prefill(i) for i in range(10)]
    sent.append(
        TokenBatch(
            worker_id="decode-0",
            iteration=1,
            entries=(
                TokenEntry(request_id="r1", first_index=0, token_ids=(5,), finish_reason=FinishReason.STOP),
            ),
        )
    )
    sent.append(Cancel(request_id="r3"))
    got = Collector()
    sub = await bus.subscribe(topic, group="workers", consumer="w1", handler=got)
    await sub.ready()
    await bus.publish_many(topic, sent[:6])
    for message in sent[6:]:
        await bus.publish(topic, message)
    await eventually(lambda: len(got.messages) == len(sent), what="all messages")
    assert sorted(got.messages, key=lambda m: m.message_id) == sorted(sent, key=lambda m: m.message_id)
    assert {d.topic for d in got.deliveries} == {topic}
    await sub.stop()
    assert await bus.backlog(topic, "workers") == 0
    assert sub.stats.handled == len(sent) and sub.stats.duplicates == 0


async def test_backlog_counts_what_the_group_has_not_acked(
    bus: Bus, new_topic: Callable[[str], str], cleanup: list[str]
) -> None:
    topic = new_topic("work")
    cleanup.append(topic)
    got = Collector()
    sub = await bus.subscribe(topic, group="workers", consumer="w1", handler=got)
    await sub.ready()
    await bus.publish_many(topic, [prefill(i) for i in range(3)])
    await eventually(lambda: len(got.messages) == 3, what="3 messages")
    await sub.stop()
    for i in range(3, 8):  # one record per produce: tansu's end offsets are exact only then
        await bus.publish(topic, prefill(i))
    assert await bus.backlog(topic, "workers") == 5


async def test_same_message_published_twice_is_handled_once(
    bus: Bus, new_topic: Callable[[str], str], cleanup: list[str]
) -> None:
    topic = new_topic("work")
    cleanup.append(topic)
    got = Collector()
    sub = await bus.subscribe(topic, group="workers", consumer="w1", handler=got)
    await sub.ready()
    message = prefill(1)
    await bus.publish(topic, message)  # a producer retry after a lost ack re-sends the same message
    await bus.publish(topic, message)
    await bus.publish(topic, prefill(2))
    await eventually(lambda: sub.stats.delivered == 3, what="3 deliveries")
    await sub.stop()
    assert [m.request_id for m in got.messages if isinstance(m, PrefillRequest)] in (
        ["r1", "r2"],
        ["r2", "r1"],
    )
    assert sub.stats.duplicates == 1


async def test_group_members_share_the_work_without_duplicates(
    bus: Bus, new_topic: Callable[[str], str], cleanup: list[str]
) -> None:
    topic = new_topic("work")
    cleanup.append(topic)
    got = Collector()
    first = await bus.subscribe(topic, group="workers", consumer="w1", handler=got)
    second = await bus.subscribe(topic, group="workers", consumer="w2", handler=got)
    await asyncio.gather(first.ready(), second.ready())
    sent = [prefill(i) for i in range(40)]
    await bus.publish_many(topic, sent)
    await eventually(lambda: len(got.messages) >= 40, what="40 messages")
    await first.stop()
    await second.stop()
    assert sorted(m.message_id for m in got.messages) == sorted(m.message_id for m in sent)


async def test_every_group_gets_every_message(
    bus: Bus, new_topic: Callable[[str], str], cleanup: list[str]
) -> None:
    topic = new_topic("events")
    cleanup.append(topic)
    per_group = {name: Collector() for name in ("gateway-0", "batcher", "decode-0")}
    subs = [await bus.subscribe(topic, group=g, consumer=g, handler=c) for g, c in per_group.items()]
    await asyncio.gather(*(sub.ready() for sub in subs))  # the groups form in parallel
    sent = [Cancel(request_id=f"r{i}") for i in range(5)]
    await bus.publish_many(topic, sent)
    await eventually(lambda: all(len(c.messages) == 5 for c in per_group.values()), what="fan-out")
    for sub in subs:
        await sub.stop()
    for collector in per_group.values():
        assert sorted(m.message_id for m in collector.messages) == sorted(m.message_id for m in sent)


async def test_undecodable_payload_is_dead_lettered_and_the_group_moves_on(
    bus: Bus, bus_url: str, new_topic: Callable[[str], str], cleanup: list[str]
) -> None:
    topic = new_topic("work")
    cleanup.append(topic)
    got = Collector()
    sub = await bus.subscribe(topic, group="workers", consumer="w1", handler=got)
    await sub.ready()
    poison = b"\x93\xabfrom_future\x09\x90"  # ["from_future", 9, []]
    await publish_raw(bus_url, topic, poison)
    await bus.publish(topic, prefill(1))
    await eventually(lambda: len(got.messages) == 1, what="the valid message")
    await sub.stop()
    assert sub.stats.dead_lettered == 1
    assert await bus.backlog(topic, "workers") == 0
    dead = await read_raw(bus_url, f"{topic}.dead", count=1)
    assert dead == [poison]


async def test_failing_handler_is_retried_then_dead_lettered(
    bus: Bus, bus_url: str, new_topic: Callable[[str], str], cleanup: list[str]
) -> None:
    topic = new_topic("work")
    cleanup.append(topic)
    tries: dict[str, int] = {}

    async def flaky(message: Message, delivery: Delivery) -> None:
        assert isinstance(message, PrefillRequest)
        tries[message.request_id] = tries.get(message.request_id, 0) + 1
        if message.request_id == "r1" and tries["r1"] < 2:
            raise ConnectionError("downstream hiccup")  # transient: the retry succeeds
        if message.request_id == "r2":
            raise ValueError("bug")  # persistent: dead-lettered after max_attempts

    sub = await bus.subscribe(topic, group="workers", consumer="w1", handler=flaky)
    await sub.ready()
    await bus.publish(topic, prefill(1))
    await bus.publish(topic, prefill(2))
    await bus.publish(topic, prefill(3))
    # r2 and r3 may sit on different Kafka partitions: wait for both outcomes, not for an order
    await eventually(
        lambda: sub.stats.handled == 2 and sub.stats.dead_lettered == 1, what="r1, r3 and r2's end"
    )
    await sub.stop()
    assert tries == {"r1": 2, "r2": 3, "r3": 1}
    assert (sub.stats.handled, sub.stats.dead_lettered) == (2, 1)
    assert await bus.backlog(topic, "workers") == 0
    assert len(await read_raw(bus_url, f"{topic}.dead", count=1)) == 1
