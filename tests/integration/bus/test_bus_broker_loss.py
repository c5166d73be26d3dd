"""A broker that loses its data (Redis FLUSHALL, a restart without persistence, a tansu restart) is used
again within 10 s: the bus re-creates its streams, topics (with their configured partitions) and groups and
says in its log what was lost. A publish rides out a short outage and fails after a long one."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from aiokafka.admin import AIOKafkaAdminClient
from bus_helpers import eventually
from own_brokers import own_redis, own_tansu

from alignedserve.bus import Bus, BusUnavailable, Delivery, connect_bus
from alignedserve.bus.base import PUBLISH_OUTAGE_S, ConsumerOptions
from alignedserve.bus.messages import Cancel, Message

RECOVERY_S = 10.0
REDIS_OPTIONS = "claim_idle_ms=500&claim_interval_ms=200&block_ms=200&socket_timeout=2"
KAFKA_OPTIONS = "session_timeout_ms=1000&heartbeat_interval_ms=200&rebalance_timeout_ms=1000&poll_ms=100"


async def _publish_until_handled(bus: Bus, topic: str, got: list[str], request_id: str) -> float:
    """Publish (again, while the broker is still coming back) until the handler saw it; seconds taken."""
    start = time.monotonic()

    def handled() -> bool:
        return request_id in got

    while not handled():
        assert time.monotonic() - start < RECOVERY_S, f"{request_id} not handled within {RECOVERY_S}s"
        try:
            await bus.publish(topic, Cancel(request_id=request_id))
        except Exception as exc:  # the broker is not back yet: try again
            logging.getLogger(__name__).info("publish failed: %r", exc)
        try:
            await eventually(handled, timeout=1.0, what=request_id)
        except AssertionError:
            continue
    return time.monotonic() - start


async def _subscribed(bus: Bus, topic: str, got: list[str]) -> None:
    async def handler(message: Message, _delivery: Delivery) -> None:
        assert isinstance(message, Cancel)
        got.append(message.request_id)

    sub = await bus.subscribe(topic, group="g", consumer="c", handler=handler)
    await sub.ready()


async def test_redis_flushall_and_restart_recreate_streams_and_groups(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="alignedserve.bus")
    topic = f"test.loss.{uuid.uuid4().hex}"
    got: list[str] = []
    with own_redis(tmp_path) as broker:
        url = f"redis://127.0.0.1:{broker.port}/0"
        bus = await connect_bus(f"{url}?{REDIS_OPTIONS}")
        try:
            await _subscribed(bus, topic, got)
            await _publish_until_handled(bus, topic, got, "before")
            redis.Redis.from_url(url).flushall()
            flushed_s = await _publish_until_handled(bus, topic, got, "after-flush")
            broker.restart()
            restarted_s = await _publish_until_handled(bus, topic, got, "after-restart")
        finally:
            await bus.close()
    assert got[0] == "before" and {"after-flush", "after-restart"} <= set(got)
    lost = [r.getMessage() for r in caplog.records if "Redis lost stream" in r.getMessage()]
    assert len(lost) >= 2, caplog.text  # once per loss: what was lost, and that the group was re-created
    assert topic in lost[0] and "re-created the group" in lost[0]
    print(f"recovered after FLUSHALL in {flushed_s:.2f}s, after a restart in {restarted_s:.2f}s")


async def test_kafka_broker_restart_recreates_topics_and_groups(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="alignedserve.bus")
    topic = f"test.loss.{uuid.uuid4().hex}"
    got: list[str] = []
    with own_tansu(tmp_path) as broker:
        bus = await connect_bus(f"kafka://127.0.0.1:{broker.port}?{KAFKA_OPTIONS}")
        try:
            await _subscribed(bus, topic, got)
            await _publish_until_handled(bus, topic, got, "before")
            broker.restart()
            restarted_s = await _publish_until_handled(bus, topic, got, "after-restart")
            partitions = await _partition_count(broker.port, topic)
        finally:
            await bus.close()
    assert got[0] == "before" and "after-restart" in got
    assert partitions == 8, "the topic came back without its configured partitions"
    lost = [r.getMessage() for r in caplog.records if "gone from the broker" in r.getMessage()]
    assert lost and topic in lost[0], caplog.text
    print(f"recovered after a tansu restart in {restarted_s:.2f}s")


async def test_publishes_after_a_tansu_sigkill_reach_a_recreated_topic_and_the_loss_is_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted tansu takes produces to a topic it lost, and a topic created after such records refuses
    produces until as many have failed: a bus whose connection broke checks its topic (creating it again)
    before its next publish, so a burst right after the restart goes through at once and is handled; the
    subscription tells `on_broker_loss`."""
    caplog.set_level(logging.INFO, logger="alignedserve.bus")
    topic = f"test.loss.{uuid.uuid4().hex}"
    got: list[str] = []
    losses: list[str] = []

    async def handler(message: Message, _delivery: Delivery) -> None:
        assert isinstance(message, Cancel)
        got.append(message.request_id)

    with own_tansu(tmp_path) as broker:
        url = f"kafka://127.0.0.1:{broker.port}?{KAFKA_OPTIONS}"
        consumer, publisher = await connect_bus(url), await connect_bus(url)  # two processes, as in a stack
        try:
            options = ConsumerOptions(on_broker_loss=losses.append)
            sub = await consumer.subscribe(topic, group="g", consumer="c", handler=handler, options=options)
            await sub.ready()
            await _publish_until_handled(publisher, topic, got, "before")
            broker.restart()
            burst = [f"after-{i}" for i in range(20)]
            started = time.monotonic()
            for request_id in burst:  # each publish rides out the broker's return on its own
                await publisher.publish(topic, Cancel(request_id=request_id))
            published_s = time.monotonic() - started
            await eventually(lambda: set(burst) <= set(got), timeout=RECOVERY_S, what="the burst")
            partitions = await _partition_count(broker.port, topic)
        finally:
            await publisher.close()
            await consumer.close()
    assert published_s < RECOVERY_S, f"the burst took {published_s:.1f}s: a partition refused produces"
    assert partitions == 8
    assert losses, "the subscription never told of the loss"
    assert "Kafka connection broke" in caplog.text
    print(f"20 publishes after a tansu SIGKILL in {published_s:.2f}s; losses told: {losses}")


async def _partition_count(port: int, topic: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}")
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
        return len(described["partitions"])
    finally:
        await admin.close()


async def test_a_publish_rides_out_a_redis_restart_and_fails_after_a_long_outage(tmp_path: Path) -> None:
    topic = f"test.loss.{uuid.uuid4().hex}"
    got: list[str] = []
    with own_redis(tmp_path) as broker:
        bus = await connect_bus(f"redis://127.0.0.1:{broker.port}/0?{REDIS_OPTIONS}")
        try:
            await _subscribed(bus, topic, got)
            broker.kill()
            back = threading.Timer(1.0, broker.start)  # a supervisor brings it back 1 s later
            back.start()
            await bus.publish(topic, Cancel(request_id="during-outage"))  # no error: sent once it is back
            back.join()
            await eventually(lambda: "during-outage" in got, timeout=RECOVERY_S, what="the message")
            broker.kill()
            started = time.monotonic()
            with pytest.raises(BusUnavailable, match="failed for"):
                await bus.publish(topic, Cancel(request_id="never"))
            assert PUBLISH_OUTAGE_S <= time.monotonic() - started < PUBLISH_OUTAGE_S + 5
        finally:
            await asyncio.wait_for(bus.close(), 30)
