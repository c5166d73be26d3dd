"""Control plane: typed msgpack messages (`messages`) on Redis Streams or Kafka (`connect_bus`)."""

from __future__ import annotations

from alignedserve.bus.base import (
    Bus,
    BusPoolTimeout,
    BusUnavailable,
    ConsumerOptions,
    Delivery,
    Handler,
    Subscription,
)
from alignedserve.bus.factory import connect_bus, make_bus
from alignedserve.bus.seen import SeenIds

__all__ = [
    "Bus",
    "BusPoolTimeout",
    "BusUnavailable",
    "ConsumerOptions",
    "Delivery",
    "Handler",
    "SeenIds",
    "Subscription",
    "connect_bus",
    "make_bus",
]
