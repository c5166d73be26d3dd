"""Consumer flow control through the one interface: a member with no room reads nothing, and a polling
member takes only what the waiting members of its group leave on the bus."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bus_helpers import eventually

from alignedserve.bus import Bus, ConsumerOptions, Delivery, connect_bus
from alignedserve.bus.messages import Cancel, Message


class Gated:
    """A handler whose consumer reads only while `open` is set; it records what it handled."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.handled: list[str] = []

    async def __call__(self, message: Message, _delivery: Delivery) -> None:
        self.handled.append(message.message_id)

    async def room(self) -> None:
        await self.open.wait()


async def test_a_member_without_room_reads_nothing_until_it_has_room(
    bus: Bus, new_topic: Callable[[str], str], cleanup: list[str]
) -> None:
    topic = new_topic("gated")
    cleanup.append(topic)
    gated = Gated()
    sub = await bus.subscribe(
        topic, group="g", consumer="c", handler=gated, options=ConsumerOptions(batch=1, room=gated.room)
    )
    await sub.ready()
    sent = [Cancel(request_id=f"r{i}") for i in range(3)]
    await bus.publish_many(topic, sent)
    await asyncio.sleep(0.5)
    assert gated.handled == []
    gated.open.set()
    await eventually(lambda: len(gated.handled) == 3, what="3 messages once there is room")
    await sub.stop()  # a stop while the member waits for room is clean too
    assert gated.handled == [m.message_id for m in sent]


async def test_a_stop_while_waiting_for_room_ends_the_subscription(
    bus: Bus, new_topic: Callable[[str], str], cleanup: list[str]
) -> None:
    topic = new_topic("closed")
    cleanup.append(topic)
    gated = Gated()  # never opened
    sub = await bus.subscribe(
        topic, group="g", consumer="c", handler=gated, options=ConsumerOptions(room=gated.room)
    )
    await sub.ready()
    await asyncio.wait_for(sub.stop(), 5)


async def test_a_polling_member_takes_only_what_the_waiting_member_leaves(
    redis_url: str, new_topic: Callable[[str], str]
) -> None:
    """Redis Streams: a new entry goes to a member blocked on the stream; one that polls (a fallback
    worker) gets entries only while the waiting member has no room and stops reading."""
    bus = await connect_bus(redis_url)
    topic = new_topic("work")
    waiting, polling = Gated(), Gated()
    waiting.open.set()
    polling.open.set()
    first = await bus.subscribe(
        topic,
        group="w",
        consumer="waits",
        handler=waiting,
        options=ConsumerOptions(batch=1, room=waiting.room),
    )
    second = await bus.subscribe(
        topic,
        group="w",
        consumer="polls",
        handler=polling,
        options=ConsumerOptions(batch=1, room=polling.room, poll_s=0.01),
    )
    await asyncio.gather(first.ready(), second.ready())
    try:
        for i in range(10):
            await bus.publish(topic, Cancel(request_id=f"a{i}"))
            await asyncio.sleep(0.05)
        await eventually(lambda: len(waiting.handled) == 10, what="the waiting member takes every entry")
        assert polling.handled == []
        waiting.open.clear()  # full: it stops reading (its read in flight takes one more entry)
        for i in range(5):
            await bus.publish(topic, Cancel(request_id=f"b{i}"))
            await asyncio.sleep(0.05)
        await eventually(lambda: len(waiting.handled) + len(polling.handled) == 15, what="15 entries")
        assert len(polling.handled) >= 4
    finally:
        waiting.open.set()
        await first.stop()
        await second.stop()
        await bus.delete_topics(topic)
        await bus.close()
