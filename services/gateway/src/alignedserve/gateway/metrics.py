"""The gateway's Prometheus metrics, named in vLLM's style (`alignedserve:` instead of `vllm:`).

Latency histograms are observed here, where the client's view is: TTFT from admission to the first
token, inter-token latency between consecutive tokens, TPOT per request ((e2e - ttft) / (tokens - 1)).
Load gauges (running / waiting requests, KV pool and decode block usage) are read from the backend at
scrape time, so they are never stale.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from alignedserve.gateway.backend import BackendStats

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class GatewayMetrics:
    """All gateway metrics in their own registry (several apps can live in one test process)."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], BackendStats],
        window_s: float = 10.0,
        migrations: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"alignedserve:{name}", doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.inter_token = hist("inter_token_latency_seconds", "Time between output tokens.", _TOKEN_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds", "Mean time per output token of a request.", _TOKEN_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", _LENGTH_BUCKETS)
        self.output_len = hist("request_generation_tokens", "Output tokens per request.", _LENGTH_BUCKETS)
        self.prompt_tokens = Counter(
            "alignedserve:prompt_tokens", "Prompt tokens admitted.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "alignedserve:generation_tokens", "Output tokens generated.", labels, registry=r
        )
        self.request_success = Counter(
            "alignedserve:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.request_failure = Counter(
            "alignedserve:request_failure",
            "Requests that failed or were cancelled.",
            [*labels, "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "alignedserve:request_rejected",
            "Requests refused before admission, by HTTP status.",
            [*labels, "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "alignedserve:gateway_requests_in_flight",
            "Requests admitted by the gateway now.",
            labels,
            registry=r,
        )
        self.model_name = model_name
        self.throughput = _ThroughputWindow(window_s)
        r.register(_BackendCollector(model_name, stats, self.throughput))
        if migrations is not None:
            r.register(_MigrationCollector(model_name, migrations))

    def record_rejection(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def record_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.prompt_len.labels(self.model_name).observe(prompt_tokens)
        self.throughput.add_prompt(prompt_tokens, time.monotonic())

    def request_timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)


class RequestTimer:
    """Per-request latency bookkeeping; `tokens(n, now)` on every chunk, `finish`/`fail` once."""

    def __init__(self, metrics: GatewayMetrics, arrival: float) -> None:
        self._m = metrics
        self._arrival = arrival
        self._first: float | None = None
        self._last = arrival
        self._tokens = 0
        self._done = False

    def tokens(self, count: int, now: float) -> None:
        if count <= 0:
            return
        model = self._m.model_name
        if self._first is None:
            self._first = now
            self._m.ttft.labels(model).observe(now - self._arrival)
            gaps = count - 1  # tokens delivered together with the first share no measurable gap
        else:
            gaps = count
        if gaps > 0 and self._tokens > 0:
            per_token = (now - self._last) / gaps
            for _ in range(gaps):
                self._m.inter_token.labels(model).observe(per_token)
        self._last = now
        self._tokens += count
        self._m.generation_tokens.labels(model).inc(count)
        self._m.throughput.add_generation(count, now)

    def finish(self, reason: str, now: float) -> None:
        if self._done:
            return
        self._done = True
        model = self._m.model_name
        self._m.e2e.labels(model).observe(now - self._arrival)
        self._m.output_len.labels(model).observe(self._tokens)
        if self._first is not None and self._tokens > 1:
            self._m.tpot.labels(model).observe((now - self._first) / (self._tokens - 1))
        self._m.request_success.labels(model, reason).inc()

    def fail(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        self._m.request_failure.labels(self._m.model_name, reason).inc()


class _ThroughputWindow:
    """Tokens/s over the last `window_s` seconds (vLLM's avg_*_throughput_toks_per_s)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._prompt: deque[tuple[float, int]] = deque()
        self._generation: deque[tuple[float, int]] = deque()

    def add_prompt(self, count: int, now: float) -> None:
        self._prompt.append((now, count))

    def add_generation(self, count: int, now: float) -> None:
        self._generation.append((now, count))

    def rates(self, now: float) -> tuple[float, float]:
        return self._rate(self._prompt, now), self._rate(self._generation, now)

    def _rate(self, events: deque[tuple[float, int]], now: float) -> float:
        while events and events[0][0] < now - self.window_s:
            events.popleft()
        return sum(count for _, count in events) / self.window_s


class _BackendCollector(Collector):
    """Gauges read at scrape time: backend load and the throughput window."""

    def __init__(self, model: str, stats: Callable[[], BackendStats], throughput: _ThroughputWindow) -> None:
        self._model = model
        self._stats = stats
        self._throughput = throughput

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats()
        prompt_rate, generation_rate = self._throughput.rates(time.monotonic())
        values = {
            "num_requests_running": ("Requests decoding now.", stats.num_requests_running),
            "num_requests_waiting": ("Requests admitted, not decoding yet.", stats.num_requests_waiting),
            "kv_pool_usage_perc": ("Host KV pool usage, 0..1.", stats.kv_pool_usage),
            "decode_kv_usage_perc": ("Decode KV block usage, 0..1.", stats.decode_kv_usage),
            "avg_prompt_throughput_toks_per_s": ("Prompt tokens/s over the window.", prompt_rate),
            "avg_generation_throughput_toks_per_s": ("Output tokens/s over the window.", generation_rate),
        }
        for name, (doc, value) in values.items():
            family = GaugeMetricFamily(f"alignedserve:{name}", doc, labels=["model_name"])
            family.add_metric([self._model], float(value))
            yield family


class _MigrationCollector(Collector):
    """`request_migrations_total{reason}`, read at scrape time from the backend's own count of requests
    it re-prefilled after their KV or worker was lost (bus backend only)."""

    def __init__(self, model: str, counts: Callable[[], Mapping[str, int]]) -> None:
        self._model = model
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "alignedserve:request_migrations",
            "Requests re-prefilled after their KV or worker was lost, by reason.",
            labels=["model_name", "reason"],
        )
        for reason, count in sorted(self._counts().items()):
            family.add_metric([self._model, reason], float(count))
        yield family
