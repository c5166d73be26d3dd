"""The decode worker's Prometheus metrics (vLLM-style names under `alignedserve:`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FAST = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
_STEP = (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.kv_usage = Gauge(
            "alignedserve:decode_kv_usage_perc", "share of this worker's KV blocks in use", registry=registry
        )
        self.running = Gauge(
            "alignedserve:decode_running_requests", "requests in the running batch", registry=registry
        )
        self.candidates = Gauge(
            "alignedserve:decode_candidate_requests",
            "requests in a candidate buffer (staged or being staged)",
            ["buffer"],
            registry=registry,
        )
        self.local_prefetch_bytes = Gauge(
            "alignedserve:decode_local_prefetch_bytes",
            "KV bytes pre-pulled into this worker's host memory, waiting for admission",
            registry=registry,
        )
        self.iteration_seconds = Histogram(
            "alignedserve:decode_iteration_seconds",
            "one decode forward (engine step)",
            buckets=_STEP,
            registry=registry,
        )
        self.scheduling_seconds = Histogram(
            "alignedserve:decode_scheduling_seconds",
            "per-iteration scheduling and bus work on the decode loop's critical path: outputs to messages,"
            " plan_iteration, status, handing the messages to the ordered publisher",
            buckets=_FAST,
            registry=registry,
        )
        self.publish_seconds = Histogram(
            "alignedserve:decode_bus_publish_seconds",
            "broker round trips of one iteration's messages (overlapping the next forward)",
            buckets=_FAST,
            registry=registry,
        )
        self.admission_stall_seconds = Histogram(
            "alignedserve:decode_admission_stall_seconds",
            "time the decode loop waits to admit requests (KV pulls not yet local, imports)",
            buckets=(*_FAST, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.prefix_spread = Histogram(
            "alignedserve:decode_prefix_spread_tokens",
            "max - min prefix length of the running batch, per iteration",
            buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            registry=registry,
        )
        self.generation_tokens = Counter(
            "alignedserve:decode_generation_tokens_total",
            "tokens generated (rate = tokens/s)",
            registry=registry,
        )
        self.prefill_wait_seconds = Counter(
            "alignedserve:decode_prefill_wait_seconds_total",
            "time decode steps waited for prefill forwards on a shared machine (the prefill-first CPU layout)",
            registry=registry,
        )
        self.iterations = Counter(
            "alignedserve:decode_iterations_total", "decode iterations run", registry=registry
        )
        self.mixed_iterations = Counter(
            "alignedserve:decode_mixed_iterations_total",
            "iterations whose running set spans 2+ batch ids (mixed_iteration_fraction = this / iterations)",
            registry=registry,
        )
        self.admitted = Counter(
            "alignedserve:decode_admitted_requests_total", "requests admitted", ["source"], registry=registry
        )
        self.evicted = Counter(
            "alignedserve:decode_evicted_requests_total", "requests evicted", ["to"], registry=registry
        )
        self.orphaned = Counter(
            "alignedserve:decode_orphaned_requests_total",
            "requests cancelled here because their gateway is gone (restarted, stopped or silent)",
            registry=registry,
        )
        self.finished = Counter(
            "alignedserve:decode_finished_requests_total", "requests finished", ["reason"], registry=registry
        )
        self.pulled_bytes = Counter(
            "alignedserve:decode_kv_pulled_bytes_total",
            "KV bytes pulled, by when (prefetch: before admission; admission: in the decode loop)",
            ["when"],
            registry=registry,
        )
