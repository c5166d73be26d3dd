"""Broker access below the bus interface, for tests that must put or read bytes that are not messages."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from alignedserve.bus.kafka import parse_url
from alignedserve.bus.redis_streams import PAYLOAD, split_url


async def publish_raw(bus_url: str, topic: str, payload: bytes) -> None:
    if bus_url.startswith("kafka://"):
        bootstrap, _ = parse_url(bus_url)
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(topic, payload)
        finally:
            await producer.stop()
        return
    client = aioredis.Redis.from_url(split_url(bus_url)[0])
    try:
        entry: dict[Any, Any] = {PAYLOAD: payload}
        await client.xadd(topic, entry)
    finally:
        await client.aclose()


async def read_raw(bus_url: str, topic: str, count: int, timeout: float = 10.0) -> list[bytes]:
    """The first `count` payloads of a topic, from the beginning, without a consumer group."""
    if bus_url.startswith("kafka://"):
        return await _read_kafka(bus_url, topic, count, timeout)
    client = aioredis.Redis.from_url(split_url(bus_url)[0])
    try:
        entries = cast(Any, await client.xrange(topic, count=count))
        return [fields[PAYLOAD] for _, fields in entries]
    finally:
        await client.aclose()


async def _read_kafka(bus_url: str, topic: str, count: int, timeout: float) -> list[bytes]:
    bootstrap, _ = parse_url(bus_url)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        for _ in range(100):
            if partitions:
                break
            await consumer._client.force_metadata_update()
            await asyncio.sleep(0.05)
            partitions = consumer.partitions_for_topic(topic) or set()
        consumer.assign([TopicPartition(topic, p) for p in partitions])
        await consumer.seek_to_beginning()
        out: list[bytes] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(out) < count and loop.time() < deadline:
            batches = await consumer.getmany(timeout_ms=100)
            out += [record.value for records in batches.values() for record in records]
        return out
    finally:
        await consumer.stop()
