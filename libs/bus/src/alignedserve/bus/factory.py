"""`connect_bus(url)`: the one way services get a bus."""

from __future__ import annotations

from urllib.parse import urlsplit

from alignedserve.bus.base import Bus

SCHEMES = ("redis", "rediss", "kafka")


def make_bus(url: str) -> Bus:
    """A bus for `url` (redis://host:port/db?... or kafka://host:port?...), not yet connected."""
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss"):
        from alignedserve.bus.redis_streams import RedisStreamsBus

        return RedisStreamsBus(url)
    if scheme == "kafka":
        from alignedserve.bus.kafka import KafkaBus

        return KafkaBus(url)
    raise ValueError(f"unsupported bus URL {url!r}: scheme must be one of {', '.join(SCHEMES)}")


async def connect_bus(url: str) -> Bus:
    """A connected bus; raises `BusUnavailable` naming the URL when the broker does not answer."""
    bus = make_bus(url)
    try:
        await bus.connect()
    except BaseException:
        await bus.close()
        raise
    return bus
