"""Metric maths against hand-computed cases."""

from __future__ import annotations

import pytest

from alignedserve.loadgen.metrics import (
    Distribution,
    benchmark_duration_s,
    itl_s,
    output_tokens_over_time,
    summarize,
    tpot_s,
)
from alignedserve.loadgen.records import TIMEOUT, RequestRecord


def done(
    index: int,
    start: float,
    chunks: list[float],
    e2el: float,
    output_len: int | None = None,
    input_len: int = 10,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        input_len=input_len,
        expected_output_len=output_len or len(chunks),
        scheduled_s=start,
        start_s=start,
        ttft_s=chunks[0] if chunks else None,
        e2el_s=e2el,
        chunk_times_s=chunks,
        output_len=len(chunks) if output_len is None else output_len,
    )


def failed(index: int, start: float, e2el: float, kind: str = TIMEOUT) -> RequestRecord:
    return RequestRecord(index, 10, 5, start, start_s=start, e2el_s=e2el, error=kind)


def test_tpot_excludes_the_first_token() -> None:
    # TTFT 0.5 s, then 4 more tokens by 1.3 s: (1.3 - 0.5) / (5 - 1) = 0.2 s
    record = done(0, 0.0, [0.5, 0.7, 0.9, 1.1, 1.3], e2el=1.3)
    assert tpot_s(record) == pytest.approx(0.2)


def test_tpot_uses_the_reported_token_count_not_chunks() -> None:
    # 2 chunks but usage says 9 tokens: (2.0 - 0.4) / (9 - 1) = 0.2 s
    record = done(0, 0.0, [0.4, 2.0], e2el=2.0, output_len=9)
    assert tpot_s(record) == pytest.approx(0.2)


def test_tpot_is_undefined_for_one_token_or_no_ttft() -> None:
    assert tpot_s(done(0, 0.0, [0.3], e2el=0.3)) is None
    no_stream = RequestRecord(0, 10, 5, 0.0, e2el_s=1.0, output_len=5)
    assert tpot_s(no_stream) is None


def test_itl_is_the_gaps_between_chunks() -> None:
    assert itl_s(done(0, 0.0, [0.5, 0.6, 1.0, 1.05], e2el=1.1)) == pytest.approx([0.1, 0.4, 0.05])
    assert itl_s(done(0, 0.0, [0.5], e2el=0.5)) == []


def test_percentiles_interpolate_linearly_between_ranks() -> None:
    # n = 5: p90 rank = 0.9 * 4 = 3.6 -> 40 + 0.6 * (100 - 40) = 76; p99 rank 3.96 -> 40 + 0.96 * 60 = 97.6
    dist = Distribution.of([10.0, 20.0, 30.0, 40.0, 100.0])
    assert dist.mean == pytest.approx(40.0)
    assert dist.median == pytest.approx(30.0)
    assert dist.percentiles[90] == pytest.approx(76.0)
    assert dist.percentiles[99] == pytest.approx(97.6)
    assert dist.std == pytest.approx(((900 + 400 + 100 + 0 + 3600) / 5) ** 0.5)


def test_empty_distribution_is_all_none() -> None:
    dist = Distribution.of([])
    assert dist.mean is None and dist.median is None and dist.percentiles == {90: None, 99: None}
    assert dist.as_ms("ttft")["p99_ttft_ms"] is None


def test_as_ms_uses_vllm_names() -> None:
    names = Distribution.of([0.001, 0.003]).as_ms("tpot")
    assert names["mean_tpot_ms"] == pytest.approx(2.0)
    assert names["median_tpot_ms"] == pytest.approx(2.0)
    assert set(names) == {"mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p90_tpot_ms", "p99_tpot_ms"}


def _run() -> list[RequestRecord]:
    return [
        done(0, 0.0, [0.2, 0.4, 0.6], e2el=0.6, input_len=100),  # ttft 0.2, tpot 0.2
        done(1, 1.0, [0.5, 0.6, 0.7, 0.8, 0.9], e2el=0.9, input_len=50),  # ttft 0.5, tpot 0.1
        failed(2, 1.5, e2el=2.5),  # ends at 4.0: the run's last moment
    ]


def test_summary_counts_throughput_and_latency() -> None:
    summary = summarize(_run())
    assert (summary.completed, summary.failed) == (2, 1)
    assert summary.duration_s == pytest.approx(4.0)  # first send 0.0 -> last end 4.0
    assert summary.total_input_tokens == 150  # failed requests do not count
    assert summary.total_output_tokens == 8
    assert summary.request_throughput == pytest.approx(2 / 4.0)
    assert summary.output_throughput == pytest.approx(8 / 4.0)
    assert summary.total_token_throughput == pytest.approx(158 / 4.0)
    assert summary.ttft.mean == pytest.approx(0.35)
    assert summary.tpot.mean == pytest.approx(0.15)
    assert summary.itl.mean == pytest.approx((2 * 0.2 + 4 * 0.1) / 6)  # 2 gaps of 0.2, 4 gaps of 0.1
    assert summary.e2el.median == pytest.approx(0.75)
    assert summary.failures == {"timeout": 1}


def test_goodput_counts_only_requests_meeting_the_predicate() -> None:
    summary = summarize(_run(), meets_slo=lambda r: r.ttft_s is not None and r.ttft_s <= 0.3)
    assert summary.good == 1
    assert summary.request_goodput == pytest.approx(1 / 4.0)
    assert summary.slo_attainment == pytest.approx(1 / 3)  # failed requests count against it


def test_summary_json_has_vllm_fields() -> None:
    data = summarize(_run()).to_json()
    for key in (
        "completed",
        "failed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "request_goodput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
    ):
        assert key in data
    assert data["mean_ttft_ms"] == pytest.approx(350.0)


def test_duration_of_an_empty_run_is_zero_and_rates_stay_finite() -> None:
    assert benchmark_duration_s([]) == 0.0
    summary = summarize([])
    assert summary.request_throughput == 0.0 and summary.slo_attainment == 0.0


def test_throughput_over_time_bins_tokens_by_arrival() -> None:
    # request 0 starts at 0: chunks at 0.2, 0.4, 1.2; request 1 starts at 1.0: chunk at 1.0+0.5=1.5
    # request 1 reported 4 tokens over its one chunk
    records = [done(0, 0.0, [0.2, 0.4, 1.2], e2el=1.2), done(1, 1.0, [0.5], e2el=0.5, output_len=4)]
    starts, rates = output_tokens_over_time(records, bin_s=1.0)
    assert starts == [0.0, 1.0]
    assert rates == pytest.approx([2.0, 5.0])
    with pytest.raises(ValueError):
        output_tokens_over_time(records, bin_s=0)
