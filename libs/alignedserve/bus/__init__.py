"""Control plane: typed msgpack messages (`messages`) on Redis Streams or Kafka (`connect_bus`)."""

from __future__ import annotations

from alignedserve.bus.base import (
    Bus,
    BusUnavailable,
    ConsumerOptions,
    Delivery,
    Handler,
    SeenIds,
    Subscription,
)
from alignedserve.bus.factory import connect_bus, make_bus

__all__ = [
    "Bus",
    "BusUnavailable",
    "ConsumerOptions",
    "Delivery",
    "Handler",
    "SeenIds",
    "Subscription",
    "connect_bus",
    "make_bus",
]
