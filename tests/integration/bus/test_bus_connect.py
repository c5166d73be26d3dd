"""`connect_bus`: URL schemes and options are checked; an absent broker is a clear error."""

from __future__ import annotations

import pytest
from redis.asyncio import BlockingConnectionPool

from alignedserve.bus import BusUnavailable, connect_bus, make_bus
from alignedserve.bus.embedded import free_port
from alignedserve.bus.kafka import KafkaBus
from alignedserve.bus.redis_streams import RedisStreamsBus, split_url


def test_scheme_picks_the_bus() -> None:
    assert isinstance(make_bus("redis://127.0.0.1:6379/0"), RedisStreamsBus)
    assert isinstance(make_bus("kafka://127.0.0.1:9092"), KafkaBus)
    with pytest.raises(ValueError, match="scheme must be one of"):
        make_bus("amqp://127.0.0.1")


def test_bus_options_ride_on_the_url() -> None:
    redis_url, options = split_url("redis://h:1/2?claim_idle_ms=500&maxlen=10&socket_timeout=3")
    assert redis_url == "redis://h:1/2?socket_timeout=3" and (options.claim_idle_ms, options.maxlen) == (
        500,
        10,
    )
    kafka = KafkaBus("kafka://a:1,b:2?partitions=3&session_timeout_ms=1000")
    assert kafka.bootstrap == "a:1,b:2" and (kafka.options.partitions, kafka.options.session_timeout_ms) == (
        3,
        1000,
    )
    with pytest.raises(ValueError, match="unknown Kafka bus option"):
        KafkaBus("kafka://a:1?linger=5")
    with pytest.raises(ValueError, match="non-negative integers"):
        split_url("redis://h:1/0?maxlen=lots")


def test_the_redis_connection_pool_is_bounded_by_url_options() -> None:
    pool = RedisStreamsBus("redis://h:1/2?max_connections=5&pool_timeout_ms=250")._redis.connection_pool
    assert isinstance(pool, BlockingConnectionPool)
    assert (pool.max_connections, pool.timeout) == (5, 0.25)
    default = RedisStreamsBus("redis://h:1/2")._redis.connection_pool
    assert (default.max_connections, default.timeout) == (64, 2.0)


@pytest.mark.parametrize("scheme", ["redis", "kafka"])
async def test_absent_broker_is_bus_unavailable(scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{free_port()}" + ("/0" if scheme == "redis" else "?request_timeout_ms=2000")
    with pytest.raises(BusUnavailable, match=url.split("?")[0]):
        await connect_bus(url)
