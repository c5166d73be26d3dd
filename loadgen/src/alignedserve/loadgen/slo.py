"""Service-level objectives: per-request SLOs (which define goodput) and the run-level gate.

Goodput = completed requests meeting every per-request SLO, per second of the run.
The gate (`--fail-on-slo`) compares the run's aggregates with their targets; any miss -> exit code 3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from alignedserve.loadgen.metrics import Summary, tpot_s
from alignedserve.loadgen.records import RequestRecord

EXIT_SLO_MISSED = 3


@dataclass(frozen=True, slots=True)
class RequestSlo:
    """Per-request latency limits in milliseconds (None: no limit). A request meets its SLO when it
    completed and each limited metric is <= its limit; TPOT is undefined for a 1-token output and
    then does not count against it."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        checks = (
            (self.ttft_ms, record.ttft_s),
            (self.e2el_ms, record.e2el_s),
        )
        for limit_ms, value_s in checks:
            if limit_ms is not None and (value_s is None or value_s * 1000.0 > limit_ms):
                return False
        tpot = tpot_s(record)
        return self.tpot_ms is None or tpot is None or tpot * 1000.0 <= self.tpot_ms

    def predicate(self) -> Callable[[RequestRecord], bool] | None:
        return self.met_by if self.any else None


@dataclass(frozen=True, slots=True)
class GateTargets:
    """Run-level targets (None: not checked)."""

    min_goodput: float | None = None  # requests/s meeting the per-request SLO
    min_slo_attainment: float | None = None  # share of all requests meeting it, 0..1
    max_p99_ttft_ms: float | None = None
    max_p99_tpot_ms: float | None = None
    max_failures: int | None = None

    @property
    def any(self) -> bool:
        return any(
            v is not None
            for v in (
                self.min_goodput,
                self.min_slo_attainment,
                self.max_p99_ttft_ms,
                self.max_p99_tpot_ms,
                self.max_failures,
            )
        )


@dataclass(frozen=True, slots=True)
class GateMiss:
    target: str  # e.g. "p99_ttft_ms"
    limit: float
    actual: float | None  # None: not measurable (no completed request had the metric)

    def describe(self) -> str:
        shown = "n/a (no completed request measured it)" if self.actual is None else f"{self.actual:.3f}"
        bound = ">=" if self.target in ("request_goodput", "slo_attainment") else "<="
        return f"SLO missed: {self.target} = {shown}, target {bound} {self.limit:g}"


def _at_least(target: str, limit: float | None, actual: float) -> GateMiss | None:
    return GateMiss(target, limit, actual) if limit is not None and actual < limit else None


def _at_most(target: str, limit: float | None, actual: float | None) -> GateMiss | None:
    if limit is None:
        return None
    return GateMiss(target, limit, actual) if actual is None or actual > limit else None


def evaluate_gate(summary: Summary, targets: GateTargets) -> list[GateMiss]:
    """Every target the run missed, in a fixed order (empty: the run passes)."""
    p99_ttft = summary.ttft.percentiles[99]
    p99_tpot = summary.tpot.percentiles[99]
    max_failures = None if targets.max_failures is None else float(targets.max_failures)
    found = [
        _at_least("request_goodput", targets.min_goodput, summary.request_goodput),
        _at_least("slo_attainment", targets.min_slo_attainment, summary.slo_attainment),
        _at_most("p99_ttft_ms", targets.max_p99_ttft_ms, None if p99_ttft is None else p99_ttft * 1000.0),
        _at_most("p99_tpot_ms", targets.max_p99_tpot_ms, None if p99_tpot is None else p99_tpot * 1000.0),
        _at_most("failed", max_failures, float(summary.failed)),
    ]
    return [miss for miss in found if miss is not None]
