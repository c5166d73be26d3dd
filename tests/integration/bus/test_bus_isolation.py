"""Two deployments on one broker (one Redis database, one Kafka cluster) never see each other's messages."""

from __future__ import annotations

import asyncio

from bus_helpers import eventually

from alignedserve.bus import Delivery, connect_bus, topics
from alignedserve.bus.messages import Cancel, Message


async def test_two_deployments_on_one_broker_do_not_cross(bus_url: str) -> None:
    got: dict[str, list[str]] = {"blue": [], "green": []}
    seen_topics: set[str] = set()
    buses = {name: await connect_bus(bus_url, deployment=f"test-{name}") for name in got}
    try:
        for name, bus in buses.items():

            async def handler(message: Message, delivery: Delivery, name: str = name) -> None:
                assert isinstance(message, Cancel)
                got[name].append(message.request_id)
                seen_topics.add(delivery.topic)

            # the same logical topic, group and consumer id in both deployments
            sub = await bus.subscribe(topics.PREFILL, group=topics.PREFILL_GROUP, consumer="prefill-0",
                                      handler=handler)  # fmt: skip
            await sub.ready()
        for name, bus in buses.items():
            await bus.publish_many(topics.PREFILL, [Cancel(request_id=f"{name}-{i}") for i in range(5)])
        await eventually(
            lambda: all(len(ids) == 5 for ids in got.values()), what="both deployments' messages"
        )
        await asyncio.sleep(0.5)  # a crossed message would arrive by now
        # Kafka spreads them over partitions (keyed by request id): order holds per partition only
        assert {name: sorted(ids) for name, ids in got.items()} == {
            name: [f"{name}-{i}" for i in range(5)] for name in got
        }
        assert seen_topics == {topics.PREFILL}  # handlers see the logical name
        for bus in buses.values():
            assert await bus.backlog(topics.PREFILL, topics.PREFILL_GROUP) == 0
    finally:
        for bus in buses.values():
            await bus.delete_topics(topics.PREFILL)
            await bus.close()
