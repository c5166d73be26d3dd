"""`connect_bus(url)`: the one way services get a bus."""

from __future__ import annotations

from urllib.parse import urlsplit

from alignedserve.bus.base import Bus
from alignedserve.bus.namespace import DEFAULT_DEPLOYMENT, namespace_for

SCHEMES = ("redis", "rediss", "kafka")


def make_bus(url: str, deployment: str = DEFAULT_DEPLOYMENT) -> Bus:
    """A bus for `url` (redis://host:port/db?... or kafka://host:port?...), not yet connected; its
    topics, groups and consumer names live in `deployment`'s namespace (`alignedserve.bus.namespace`)."""
    scheme = urlsplit(url).scheme
    namespace = namespace_for(deployment)
    if scheme in ("redis", "rediss"):
        from alignedserve.bus.redis_streams import RedisStreamsBus

        return RedisStreamsBus(url, namespace)
    if scheme == "kafka":
        from alignedserve.bus.kafka import KafkaBus

        return KafkaBus(url, namespace)
    raise ValueError(f"unsupported bus URL {url!r}: scheme must be one of {', '.join(SCHEMES)}")


async def connect_bus(url: str, deployment: str = DEFAULT_DEPLOYMENT) -> Bus:
    """A connected bus; raises `BusUnavailable` naming the URL when the broker does not answer."""
    bus = make_bus(url, deployment)
    try:
        await bus.connect()
    except BaseException:
        await bus.close()
        raise
    return bus
