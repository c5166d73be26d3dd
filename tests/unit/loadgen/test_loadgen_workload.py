"""Workload building and arrival processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from alignedserve.core.workloads.arrivals import ClosedLoop, PoissonArrivals, TraceTimestamps, choose_arrivals
from alignedserve.core.workloads.build import WorkloadConfig, build_specs
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.transforms import cap_lengths


def test_synthetic_respects_ranges_share_scale_and_caps() -> None:
    config = WorkloadConfig(
        num_requests=400, short_share=0.5, seed=3, short_range=(10, 20), long_range=(100, 200)
    )
    specs = build_specs(config)
    assert len(specs) == 400
    assert all(10 <= s.input_len <= 20 or 100 <= s.input_len <= 200 for s in specs)
    shorts = sum(s.input_len <= 20 for s in specs)
    assert 150 < shorts < 250
    scaled = build_specs(
        WorkloadConfig(
            num_requests=400,
            short_share=0.5,
            seed=3,
            short_range=(10, 20),
            long_range=(100, 200),
            length_scale=0.5,
            max_input_len=80,
            max_output_len=7,
        )
    )
    assert max(s.input_len for s in scaled) == 80 and max(s.output_len for s in scaled) <= 7
    assert build_specs(config) == specs  # same seed, same workload


def test_trace_source_reads_the_packaged_trace_and_tiles_past_its_end() -> None:
    specs = build_specs(WorkloadConfig(source="trace", num_requests=5))
    assert [s.input_len for s in specs[:2]] == [374, 396] and specs[0].arrival_s == 0.0
    assert specs[1].arrival_s == pytest.approx(4.3145788)


def test_trace_source_reads_jsonl(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 1000, "input_length": 5, "output_length": 2}\n'
        '{"timestamp": 3500, "input_length": 7, "output_length": 3}\n'
    )
    specs = build_specs(WorkloadConfig(source="trace", trace_path=trace, num_requests=2))
    assert specs == [RequestSpec(0.0, 5, 2), RequestSpec(2.5, 7, 3)]


def test_dataset_sources_differ_in_shape() -> None:
    share = build_specs(WorkloadConfig(source="sharegpt", num_requests=300))
    long = build_specs(WorkloadConfig(source="longbench", num_requests=300))
    assert sum(s.input_len for s in long) > 10 * sum(s.input_len for s in share)


def test_caps_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        cap_lengths([RequestSpec(0.0, 5, 5)], 0, None)


def test_choose_arrivals_precedence() -> None:
    assert choose_arrivals("trace", None, None, time_scale=0.5) == TraceTimestamps(0.5)
    assert choose_arrivals("trace", None, 4) == ClosedLoop(4)
    assert choose_arrivals("synthetic", 2.0, 8, seed=1) == PoissonArrivals(2.0, 1, 8)
    with pytest.raises(ValueError, match="--request-rate"):
        choose_arrivals("synthetic", None, None)
    with pytest.raises(ValueError):
        choose_arrivals("synthetic", None, 0)


def test_schedules() -> None:
    specs = [RequestSpec(float(i), 5, 5) for i in range(50)]
    assert [s.arrival_s for s in TraceTimestamps(0.5).schedule(specs)][:3] == [0.0, 0.5, 1.0]
    assert all(s.arrival_s == 0.0 for s in ClosedLoop(3).schedule(specs))
    assert all(s.arrival_s == 0.0 for s in PoissonArrivals(math.inf).schedule(specs))
    poisson = [s.arrival_s for s in PoissonArrivals(10.0, seed=2).schedule(specs)]
    assert poisson == sorted(poisson) and 2.0 < poisson[-1] < 9.0  # 49 gaps of mean 0.1 s
