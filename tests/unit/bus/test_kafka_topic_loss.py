"""A Kafka subscription takes a topic that vanished from its client's metadata for lost by the broker: its
partitions are read from their start at the next assignment, even when another process has created the
topic again by the time this one rejoins (and a commit retried onto the new broker looks like a valid
one). Driven through aiokafka's own metadata cache, with the responses a broker would send; no broker."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import UnknownTopicOrPartitionError
from aiokafka.protocol.metadata import MetadataResponse_v0

from alignedserve.bus.base import ConsumerOptions, Delivery, Dispatcher
from alignedserve.bus.kafka import KafkaOptions, KafkaSubscription
from alignedserve.bus.messages import Message

TOPIC = "alignedserve.test.loss"
BROKER = (0, "127.0.0.1", 9092)  # node id, host, port (MetadataResponse v0)


def _with_partitions(count: int) -> MetadataResponse_v0:
    partitions = [(0, p, 0, [0], [0]) for p in range(count)]  # error, partition, leader, replicas, isr
    return MetadataResponse_v0(brokers=[BROKER], topics=[(0, TOPIC, partitions)])


def _unknown_topic() -> MetadataResponse_v0:
    return MetadataResponse_v0(brokers=[BROKER], topics=[(UnknownTopicOrPartitionError.errno, TOPIC, [])])


async def _handler(_message: Message, _delivery: Delivery) -> None:
    raise AssertionError("no message is consumed here")


async def _nothing_recreated(_names: list[str]) -> list[str]:
    return []


async def _no_dead_letter(_topic: str, _payload: bytes, _error: str) -> None:
    raise AssertionError("nothing is dead-lettered here")


async def _subscription() -> KafkaSubscription:  # never started: no broker is asked
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9092", group_id="g", enable_auto_commit=False)
    dispatcher = Dispatcher(_handler, ConsumerOptions(), _no_dead_letter, "kafka:g/c")
    return KafkaSubscription(consumer, KafkaOptions(), dispatcher, {TOPIC: "loss"}, _nothing_recreated)


async def test_a_topic_gone_from_the_metadata_is_read_from_its_start_even_once_back() -> None:
    sub = await _subscription()
    try:
        cluster = sub._consumer._client.cluster
        cluster.update_metadata(_with_partitions(8))
        assert TOPIC not in sub.listener.rewind
        cluster.update_metadata(_unknown_topic())  # the broker restarted without its storage
        assert TOPIC in sub.listener.rewind and TOPIC in sub._missing
        cluster.update_metadata(_with_partitions(8))  # another process created it again first
        assert TOPIC in sub.listener.rewind, "the next assignment must still read it from its start"
        assert TOPIC not in sub._missing
    finally:
        await sub._consumer.stop()


async def test_a_topic_not_yet_created_is_not_taken_for_lost() -> None:
    sub = await _subscription()
    try:
        cluster = sub._consumer._client.cluster
        cluster.update_metadata(_unknown_topic())  # subscribed before its creation reached the metadata
        cluster.update_metadata(_with_partitions(8))
        assert not sub.listener.rewind and not sub._missing
    finally:
        await sub._consumer.stop()
