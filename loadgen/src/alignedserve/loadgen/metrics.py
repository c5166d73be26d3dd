"""Latency and throughput maths — pure functions over `RequestRecord`s.

Definitions (per request, over the completed ones; see docs/loadgen.md):
  TTFT = time of the first output chunk - send time
  E2EL = time the response completed - send time
  TPOT = (E2EL - TTFT) / (output_tokens - 1)   (the first token is excluded; undefined for 1 token)
  ITL  = gaps between consecutive output chunks of one request (pooled over all requests)
Percentiles (the median too) are `alignedserve.core.stats.percentile`: linear interpolation between
closest ranks (numpy's default), rank = p/100 * (n - 1). std is the population standard deviation.
Names of the aggregated values follow vLLM's benchmark_serving results where they overlap.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from alignedserve.core.stats import percentile
from alignedserve.loadgen.records import RequestRecord

PERCENTILES = (90, 99)


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first; None when it is undefined (no TTFT or < 2 tokens)."""
    if record.ttft_s is None or record.e2el_s is None or record.output_len < 2:
        return None
    return (record.e2el_s - record.ttft_s) / (record.output_len - 1)


def itl_s(record: RequestRecord) -> list[float]:
    """Gaps between consecutive output chunks of one request."""
    times = record.chunk_times_s
    return [later - earlier for earlier, later in itertools.pairwise(times)]


@dataclass(frozen=True, slots=True)
class Distribution:
    """mean / median / std / p90 / p99 of a sample, in seconds; all None for an empty sample."""

    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[int, float | None]

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(None, None, None, dict.fromkeys(PERCENTILES))
        return cls(
            mean=statistics.fmean(values),
            median=percentile(values, 50),
            std=statistics.pstdev(values),
            percentiles={p: percentile(values, p) for p in PERCENTILES},
        )

    def as_ms(self, name: str) -> dict[str, float | None]:
        """vLLM-style keys: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p90_ttft_ms, p99_ttft_ms."""

        def ms(value: float | None) -> float | None:
            return None if value is None else value * 1000.0

        out = {f"mean_{name}_ms": ms(self.mean), f"median_{name}_ms": ms(self.median)}
        out[f"std_{name}_ms"] = ms(self.std)
        out |= {f"p{p}_{name}_ms": ms(v) for p, v in self.percentiles.items()}
        return out


def _present(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def benchmark_duration_s(records: Sequence[RequestRecord]) -> float:
    """First send to last completion (failed requests' ends count: they occupied the run too)."""
    started = [r.start_s for r in records]
    ended = [r.end_s for r in records if r.end_s is not None]
    if not started or not ended:
        return 0.0
    return max(ended) - min(started)


@dataclass(frozen=True, slots=True)
class Summary:
    """Aggregated metrics of one run; `to_json` gives the vLLM-compatible flat object."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    good: int  # completed requests meeting every per-request SLO
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    failures: dict[str, int]

    def _per_second(self, amount: float) -> float:
        return amount / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        return self._per_second(self.completed)

    @property
    def output_throughput(self) -> float:
        return self._per_second(self.total_output_tokens)

    @property
    def total_token_throughput(self) -> float:
        return self._per_second(self.total_input_tokens + self.total_output_tokens)

    @property
    def request_goodput(self) -> float:
        return self._per_second(self.good)

    @property
    def slo_attainment(self) -> float:
        """Share of all requests (failed ones included) that completed within every SLO."""
        total = self.completed + self.failed
        return self.good / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "slo_attainment": self.slo_attainment,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            distribution: Distribution = getattr(self, name)
            out |= distribution.as_ms(name)
        out["failures"] = dict(self.failures)
        return out


def summarize(
    records: Sequence[RequestRecord], meets_slo: Callable[[RequestRecord], bool] | None = None
) -> Summary:
    """Aggregate a run. `meets_slo` decides goodput per completed request (None: every one counts)."""
    done = [r for r in records if r.ok]
    good = sum(1 for r in done if meets_slo is None or meets_slo(r))
    return Summary(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=benchmark_duration_s(records),
        total_input_tokens=sum(r.input_len for r in done),
        total_output_tokens=sum(r.output_len for r in done),
        good=good,
        ttft=Distribution.of(_present([r.ttft_s for r in done])),
        tpot=Distribution.of(_present([tpot_s(r) for r in done])),
        itl=Distribution.of([gap for r in done for gap in itl_s(r)]),
        e2el=Distribution.of(_present([r.e2el_s for r in done])),
        failures=dict(Counter(r.error for r in records if r.error is not None)),
    )


def output_tokens_over_time(
    records: Sequence[RequestRecord], bin_s: float
) -> tuple[list[float], list[float]]:
    """(bin start times, output tokens/s per bin) over the run, from every chunk's arrival.

    A chunk's tokens are spread evenly over its request's chunks, so a server that reports usage but
    packs several tokens per chunk still sums to its true token count.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    done = [r for r in records if r.ok and r.chunk_times_s]
    if not done:
        return [], []
    origin = min(r.start_s for r in records)
    arrivals = [
        (r.start_s + t - origin, r.output_len / len(r.chunk_times_s)) for r in done for t in r.chunk_times_s
    ]
    bins = int(max(t for t, _ in arrivals) // bin_s) + 1
    tokens = [0.0] * bins
    for t, weight in arrivals:
        tokens[int(t // bin_s)] += weight
    return [i * bin_s for i in range(bins)], [count / bin_s for count in tokens]
