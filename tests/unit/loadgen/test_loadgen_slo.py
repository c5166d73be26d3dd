"""Per-request SLOs (goodput) and the run-level gate."""

from __future__ import annotations

import pytest

from alignedserve.loadgen.metrics import summarize
from alignedserve.loadgen.records import CONNECTION, RequestRecord
from alignedserve.loadgen.slo import GateMiss, GateTargets, RequestSlo, evaluate_gate


def record(ttft: float, e2el: float, tokens: int, error: str | None = None) -> RequestRecord:
    # evenly spaced tokens after the first
    gap = (e2el - ttft) / (tokens - 1) if tokens > 1 else 0.0
    chunks = [ttft + i * gap for i in range(tokens)]
    return RequestRecord(0, 10, tokens, 0.0, 0.0, ttft, e2el, chunks, tokens, error=error)


def test_request_slo_checks_every_limit() -> None:
    slo = RequestSlo(ttft_ms=500, tpot_ms=100)
    assert slo.met_by(record(0.5, 0.5 + 0.1 * 9, 10))  # both exactly at the limit
    assert not slo.met_by(record(0.51, 1.0, 10))  # TTFT over
    assert not slo.met_by(record(0.1, 0.1 + 0.11 * 9, 10))  # TPOT 110 ms over
    assert slo.met_by(record(0.2, 0.2, 1))  # TPOT undefined for one token: only TTFT counts
    assert not slo.met_by(record(0.1, 0.2, 2, error=CONNECTION))  # failed requests never meet it
    assert not RequestSlo(e2el_ms=1000).met_by(record(0.1, 1.5, 3))


def test_no_slo_means_no_predicate() -> None:
    assert RequestSlo().predicate() is None
    assert RequestSlo(ttft_ms=1).predicate() is not None


def test_gate_passes_when_every_target_is_met() -> None:
    summary = summarize([record(0.1, 1.0, 10), record(0.2, 1.1, 10)], RequestSlo(ttft_ms=300).predicate())
    targets = GateTargets(
        min_goodput=1.0, min_slo_attainment=1.0, max_p99_ttft_ms=300, max_p99_tpot_ms=150, max_failures=0
    )
    assert evaluate_gate(summary, targets) == []


def test_gate_names_each_missed_target() -> None:
    records = [record(0.1, 1.0, 10), record(0.9, 1.8, 10), record(0.1, 0.2, 2, error=CONNECTION)]
    summary = summarize(records, RequestSlo(ttft_ms=300).predicate())
    # duration 1.8 s, 1 good request: goodput 0.556/s; attainment 1/3; p99 TTFT = 100 + 0.99 * 800 = 892 ms
    targets = GateTargets(
        min_goodput=1.0, min_slo_attainment=0.5, max_p99_ttft_ms=500, max_p99_tpot_ms=1000, max_failures=0
    )
    misses = evaluate_gate(summary, targets)
    assert [m.target for m in misses] == ["request_goodput", "slo_attainment", "p99_ttft_ms", "failed"]
    assert misses[0].actual == pytest.approx(1 / 1.8)
    assert misses[2].actual == pytest.approx(892.0)
    assert misses[3] == GateMiss("failed", 0.0, 1.0)
    assert "p99_ttft_ms = 892.000, target <= 500" in misses[2].describe()


def test_gate_misses_a_percentile_nothing_measured() -> None:
    summary = summarize([record(0.1, 0.2, 2, error=CONNECTION)])
    (miss,) = evaluate_gate(summary, GateTargets(max_p99_ttft_ms=1000))
    assert miss.actual is None and "n/a" in miss.describe()
