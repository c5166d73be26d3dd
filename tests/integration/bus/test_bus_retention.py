"""Streams do not grow without bound: MAXLEN ~ trims every stream, and a process's own inbox expires once
nobody reads or writes it (a restarted pod comes back under a new id and leaves its old inbox behind)."""

from __future__ import annotations

import uuid

import redis
from bus_helpers import eventually

from alignedserve.bus import Delivery, connect_bus, topics
from alignedserve.bus.messages import Cancel, Message


async def test_streams_are_trimmed_and_only_inboxes_expire(redis_url: str) -> None:
    gateway = f"gw-{uuid.uuid4().hex[:8]}"
    work = f"test.retention.{uuid.uuid4().hex}"
    inbox = topics.tokens(gateway)
    sep = "&" if "?" in redis_url else "?"
    bus = await connect_bus(f"{redis_url}{sep}maxlen=100&inbox_ttl_s=60&claim_interval_ms=200")
    raw = redis.Redis.from_url(redis_url)
    try:
        await bus.publish_many(work, [Cancel(request_id=str(i)) for i in range(1000)])
        await bus.publish(inbox, Cancel(request_id="to-a-gateway"))
        assert raw.xlen(work) < 1000  # approximate: whole macro nodes of old entries are dropped
        assert raw.ttl(work) == -1  # shared work topics live on, trimmed by length only
        assert 0 < raw.ttl(inbox) <= 60

        async def handler(_message: Message, _delivery: Delivery) -> None:
            return None

        raw.persist(inbox)
        sub = await bus.subscribe(inbox, group=f"gateway-{gateway}", consumer=gateway, handler=handler)
        await sub.ready()
        # its reader keeps it alive: it expires only once the reader is gone too
        await eventually(lambda: 0 < raw.ttl(inbox) <= 60, timeout=5, what="the reader refreshing the TTL")
        await sub.stop()
    finally:
        await bus.delete_topics(work, inbox)
        await bus.close()
        raw.close()
