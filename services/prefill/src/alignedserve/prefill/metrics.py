"""The prefill worker's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from alignedserve.transfer.kv_store import KvStore


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry, staging: KvStore) -> None:
        self.queued = Gauge("alignedserve:prefill_queued_requests", "prompts waiting here", registry=registry)
        self.prompt_tokens = Counter(
            "alignedserve:prompt_tokens_total", "prompt tokens prefilled", registry=registry
        )
        self.prefill_seconds = Histogram(
            "alignedserve:prefill_forward_seconds",
            "one prefill forward (a chunk of every prompt it holds, within --max-prefill-tokens)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.pool_full_waits = Counter(
            "alignedserve:prefill_pool_full_waits_total",
            "back-offs because the KV pool was full",
            registry=registry,
        )
        self.staged = Counter(
            "alignedserve:prefill_staged_requests_total",
            "requests staged in the candidate buffers",
            registry=registry,
        )
        self.staged_lease_expired = Counter(
            "alignedserve:prefill_staged_lease_expired_total",
            "staged entries freed because no decode worker pulled them within --staging-lease-ttl-s",
            registry=registry,
        )
        staged_bytes = Gauge(
            "alignedserve:prefill_staged_bytes",
            "bytes of KV held in the candidate buffers",
            registry=registry,
        )
        staged_bytes.set_function(lambda: staging.used_bytes)
