"""The batcher's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class BatcherMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.waiting = Gauge(
            "alignedserve:batcher_waiting_requests", "requests waiting in the pool index", registry=registry
        )
        self.plans = Counter(
            "alignedserve:batcher_plans_total", "batch plans sent", ["buffer"], registry=registry
        )
        self.planned_requests = Counter(
            "alignedserve:batcher_planned_requests_total",
            "requests sent in plans",
            ["buffer"],
            registry=registry,
        )
        self.batch_spread = Histogram(
            "alignedserve:batcher_batch_prefix_spread_tokens",
            "max - min prefix length of a formed batch",
            buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            registry=registry,
        )
        self.decide_seconds = Histogram(
            "alignedserve:batcher_decision_seconds",
            "time to handle one message and form what it allows",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2),
            registry=registry,
        )
