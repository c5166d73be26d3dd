"""Metrics every back-end worker exports besides its own: its control-bus consumers and its KV transfers.

- `alignedserve:bus_consume_lag_seconds{group}` (histogram): a message's `created_at` (the publisher's
  clock) to its handler starting here — how far this consumer group runs behind the bus. Observed per
  message, so an idle group shows no samples (no rate), not a stale value.
- `alignedserve:bus_messages_handled_total`, `..._dead_lettered_total`, `..._redelivered_total{group}`:
  read from the subscriptions' own counts at scrape time.
- `alignedserve:kv_transfers_total`, `alignedserve:kv_transfer_retries_total`,
  `alignedserve:kv_transfer_failures_total` (every attempt failed: the request is re-prefilled) and
  `alignedserve:kv_transfer_bytes_total{direction}`: this worker's UCX client, read at scrape time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from alignedserve.bus import ConsumerOptions, Subscription

LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class BusMetrics:
    """Consumer-group metrics of one worker; `options(group, ...)` before subscribing, `track` after."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lag = Histogram(
            "alignedserve:bus_consume_lag_seconds",
            "control message created (publisher clock) -> its handler starts here, by consumer group",
            ["group"],
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self._subscriptions: list[tuple[str, Subscription]] = []
        registry.register(_SubscriptionCollector(self._subscriptions))

    def options(self, group: str, options: ConsumerOptions | None) -> ConsumerOptions:
        return dataclasses.replace(options or ConsumerOptions(), observe_lag=self.lag.labels(group).observe)

    def track(self, group: str, subscription: Subscription) -> None:
        self._subscriptions.append((group, subscription))


class _SubscriptionCollector(Collector):
    def __init__(self, subscriptions: list[tuple[str, Subscription]]) -> None:
        self._subscriptions = subscriptions

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = {
            "handled": "messages whose handler completed",
            "dead_lettered": "messages moved to the dead-letter topic (undecodable, or the handler kept failing)",
            "redelivered": "messages delivered again after a consumer died or restarted",
        }
        for name, doc in counts.items():
            family = CounterMetricFamily(f"alignedserve:bus_messages_{name}", doc, labels=["group"])
            totals: dict[str, int] = {}
            for group, subscription in self._subscriptions:
                totals[group] = totals.get(group, 0) + getattr(subscription.stats, name)
            for group, total in sorted(totals.items()):
                family.add_metric([group], float(total))
            yield family


class TransferCounts(Protocol):
    """What a UCX transfer client counts (alignedserve.transfer.ClientStats)."""

    transfers: int
    retries: int
    failures: int
    bytes_received: int
    bytes_sent: int
    bytes_by_memory: dict[tuple[str, str], int]

    @property
    def negotiation(self) -> Negotiated | None: ...  # read-only: a client's concrete type is a subtype


class Negotiated(Protocol):
    """What the UCX context offers (alignedserve.transfer.negotiation.UcxNegotiation)."""

    version: str
    transports: tuple[str, ...]

    @property
    def device_direct(self) -> bool: ...


def register_transfer_metrics(registry: CollectorRegistry, stats: Callable[[], TransferCounts]) -> None:
    registry.register(_TransferCollector(stats))


class _TransferCollector(Collector):
    def __init__(self, stats: Callable[[], TransferCounts]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._stats()
        plain = {
            "kv_transfers": ("KV pulls and pushes started by this worker", stats.transfers),
            "kv_transfer_retries": (
                "KV transfer attempts retried (corrupt, timed out, peer lost)",
                stats.retries,
            ),
            "kv_transfer_failures": (
                "KV transfers that failed on every attempt (the request is re-prefilled)",
                stats.failures,
            ),
        }
        for name, (doc, value) in plain.items():
            family = CounterMetricFamily(f"alignedserve:{name}", doc)
            family.add_metric([], float(value))
            yield family
        moved = CounterMetricFamily(
            "alignedserve:kv_transfer_bytes", "KV bytes moved by this worker's client", labels=["direction"]
        )
        moved.add_metric(["received"], float(stats.bytes_received))
        moved.add_metric(["sent"], float(stats.bytes_sent))
        yield moved
        yield from _negotiated(stats)


def _negotiated(stats: TransferCounts) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """KV bytes by this side's memory type (cuda: UCX moved device memory), and the UCX transports."""
    by_memory = CounterMetricFamily(
        "alignedserve:kv_transfer_memory_bytes",
        "KV bytes moved by this worker's client, by direction and this side's buffer memory (cuda | host)",
        labels=["direction", "memory"],
    )
    for (direction, memory), nbytes in sorted(stats.bytes_by_memory.items()):
        by_memory.add_metric([direction, memory], float(nbytes))
    yield by_memory
    if stats.negotiation is not None:
        info = GaugeMetricFamily(
            "alignedserve:ucx_transports_info",
            "UCX version and the transports its context activated; device_direct: cuda_ipc or RDMA present",
            labels=["version", "transports", "device_direct"],
        )
        negotiated = stats.negotiation
        info.add_metric(
            [negotiated.version, ",".join(negotiated.transports), str(negotiated.device_direct).lower()], 1.0
        )
        yield info
