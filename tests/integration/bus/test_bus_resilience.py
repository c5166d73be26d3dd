"""A subscription outlives a broker that stops answering for longer than the client's socket timeout."""

from __future__ import annotations

import asyncio
import uuid

import redis
from bus_helpers import eventually

from alignedserve.bus import Delivery, connect_bus
from alignedserve.bus.messages import Cancel, Message


async def test_redis_consumer_resumes_after_the_broker_stalls_past_the_socket_timeout(redis_url: str) -> None:
    topic = f"test.resilience.{uuid.uuid4().hex}"
    got: list[str] = []

    async def handler(message: Message, _delivery: Delivery) -> None:
        assert isinstance(message, Cancel)
        got.append(message.request_id)

    # a 1 s socket timeout, and a pause of 2.5 s: every read in between times out
    sep = "&" if "?" in redis_url else "?"
    bus = await connect_bus(f"{redis_url}{sep}block_ms=200&socket_timeout=1")
    try:
        sub = await bus.subscribe(topic, group="g", consumer="c", handler=handler)
        await bus.publish(topic, Cancel(request_id="before"))
        await eventually(lambda: got == ["before"], what="the first message")
        redis.Redis.from_url(redis_url).execute_command("CLIENT", "PAUSE", "2500", "ALL")
        await asyncio.sleep(3.0)
        await bus.publish(topic, Cancel(request_id="after"))
        await eventually(lambda: got == ["before", "after"], timeout=20, what="a message after the stall")
        assert sub.running
        await sub.stop()
    finally:
        await bus.delete_topics(topic)
        await bus.close()
