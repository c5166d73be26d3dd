"""The metrics every worker exports besides its own: bus consumer lag and counts, KV transfer counts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from alignedserve.bus.base import ConsumerOptions, ConsumerStats, Delivery, Dispatcher
from alignedserve.bus.messages import Cancel, Message, encode
from alignedserve.service.ops_metrics import BusMetrics, register_transfer_metrics
from alignedserve.transfer.client import ClientStats


class _Sub:
    def __init__(self, stats: ConsumerStats) -> None:
        self.stats = stats


async def _ignore(message: Message, delivery: Delivery) -> None:
    return None


async def _no_dead_letter(topic: str, payload: bytes, error: str) -> None:
    return None


async def test_consume_lag_is_observed_per_message_by_group() -> None:
    registry = CollectorRegistry()
    metrics = BusMetrics(registry)
    options = metrics.options("prefill", ConsumerOptions(batch=8))
    assert options.batch == 8  # the caller's options are kept
    dispatcher = Dispatcher(_ignore, options, _no_dead_letter, "test")
    message = Cancel(request_id="r")
    await dispatcher.dispatch(encode(message), Delivery("t", "1-0", False), lambda: message.created_at + 0.3)
    metrics.track("prefill", dispatcher)  # type: ignore[arg-type]  # anything with .stats
    metrics.track("prefill", _Sub(ConsumerStats(handled=4, dead_lettered=1)))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'alignedserve:bus_consume_lag_seconds_bucket{group="prefill",le="0.25"} 0.0' in text
    assert 'alignedserve:bus_consume_lag_seconds_bucket{group="prefill",le="0.5"} 1.0' in text
    assert 'alignedserve:bus_messages_handled_total{group="prefill"} 5.0' in text
    assert 'alignedserve:bus_messages_dead_lettered_total{group="prefill"} 1.0' in text
    assert 'alignedserve:bus_messages_redelivered_total{group="prefill"} 0.0' in text


def test_transfer_counts_are_read_at_scrape_time() -> None:
    registry = CollectorRegistry()
    stats = ClientStats()
    register_transfer_metrics(registry, lambda: stats)
    stats.transfers, stats.retries, stats.failures, stats.bytes_sent = 7, 2, 1, 4096
    text = generate_latest(registry).decode()
    assert "alignedserve:kv_transfers_total 7.0" in text
    assert "alignedserve:kv_transfer_retries_total 2.0" in text
    assert "alignedserve:kv_transfer_failures_total 1.0" in text
    assert 'alignedserve:kv_transfer_bytes_total{direction="sent"} 4096.0' in text
