"""Workload parsing (Azure CSV, JSONL, errors), generators and transforms."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.synthetic import longbench_like, sharegpt_like, synthetic
from alignedserve.core.workloads.traces import TraceFormatError, default_trace_path, read_trace
from alignedserve.core.workloads.transforms import scale_lengths, scale_time, take, with_poisson_arrivals


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_reads_azure_csv_relative_and_sorted(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:50.5000000,396,109\n"
        "2023-11-16 18:15:46.0000000,374,44\n",
    )
    assert read_trace(path) == [RequestSpec(0.0, 374, 44), RequestSpec(4.5, 396, 109)]


def test_reads_jsonl_milliseconds(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 1000, "input_length": 10, "output_length": 5},
        {"timestamp": 3500.0, "input_length": 20, "output_length": 7},
    ]
    path = _write(tmp_path, "t.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert read_trace(str(path)) == [RequestSpec(0.0, 10, 5), RequestSpec(2.5, 20, 7)]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.csv", "", "empty file"),
        ("b.csv", "time,in,out\n1,2,3\n", "CSV header"),
        ("c.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
        ("d.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", ":2: bad TIMESTAMP"),
        ("e.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,-4,2\n", "ContextTokens"),
        ("f.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,4\n", "3 columns"),
        ("g.jsonl", '{"timestamp": 1, "input_length": 3}\n', "need keys"),
        ("h.jsonl", '{"timestamp": 1, "input_length": 3, "output_length": 0}\n', "output_length"),
        ("i.jsonl", '{"timestamp": "x", "input_length": 3, "output_length": 2}\n', "milliseconds"),
        ("j.jsonl", '{"timestamp": 1, "input_length": 3, "output_length": 2}\n{oops\n', ":2: not JSON"),
    ],
)
def test_malformed_trace_names_the_problem(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        read_trace(_write(tmp_path, name, text))


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "absent.csv")


def test_packaged_azure_trace() -> None:
    trace = read_trace(default_trace_path())
    assert len(trace) == 19_366
    assert trace[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(trace))
    # DESIGN.md §6: context mean 1,154, output mean 211
    assert round(statistics.mean(s.input_len for s in trace)) == 1155
    assert round(statistics.mean(s.output_len for s in trace)) == 211


def test_synthetic_mix_and_determinism() -> None:
    specs = synthetic(4000, short_share=0.95, seed=7)
    assert specs == synthetic(4000, short_share=0.95, seed=7)
    assert specs != synthetic(4000, short_share=0.95, seed=8)
    shorts = [s for s in specs if s.input_len < 1000]
    assert 0.93 < len(shorts) / len(specs) < 0.97
    assert all(16 <= s.input_len <= 8000 and 16 <= s.output_len <= 512 for s in specs)
    assert all(s.arrival_s == 0.0 for s in specs)
    assert all(s.input_len < 1000 for s in synthetic(50, short_share=1.0, seed=1))
    assert all(s.input_len >= 1000 for s in synthetic(50, short_share=0.0, seed=1))


@pytest.mark.parametrize("kwargs", [{"short_share": 1.5}, {"short_share": 0.5, "short": (0, 10)}])
def test_synthetic_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        synthetic(10, seed=1, **kwargs)  # type: ignore[arg-type]


def test_published_length_distributions() -> None:
    chat = sharegpt_like(20_000, seed=3)
    assert 140 < statistics.mean(s.input_len for s in chat) < 180
    assert 300 < statistics.mean(s.output_len for s in chat) < 370
    long_ctx = longbench_like(5_000, seed=3)
    assert all(1000 <= s.input_len <= 16000 and 8 <= s.output_len <= 512 for s in long_ctx)
    assert statistics.median(s.input_len for s in long_ctx) > 5000
    assert chat == sharegpt_like(20_000, seed=3)


def test_poisson_arrivals_rate() -> None:
    specs = with_poisson_arrivals(synthetic(5000, 0.9, seed=1), rate=50.0, seed=2)
    assert specs[0].arrival_s == 0.0
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(specs)]
    assert all(g >= 0 for g in gaps)
    assert 0.018 < statistics.mean(gaps) < 0.022
    with pytest.raises(ValueError):
        with_poisson_arrivals(specs, rate=0.0, seed=1)


def test_scaling_transforms() -> None:
    specs = [RequestSpec(2.0, 10, 3), RequestSpec(4.0, 1, 1)]
    assert scale_time(specs, 0.5) == [RequestSpec(1.0, 10, 3), RequestSpec(2.0, 1, 1)]
    assert scale_lengths(specs, 0.5) == [RequestSpec(2.0, 5, 2), RequestSpec(4.0, 1, 1)]
    with pytest.raises(ValueError):
        scale_lengths(specs, 0)
    with pytest.raises(ValueError):
        scale_time(specs, -1)


def test_take_truncates_and_tiles_with_time_offsets() -> None:
    specs = [RequestSpec(0.0, 1, 1), RequestSpec(1.0, 2, 2), RequestSpec(3.0, 3, 3)]
    assert take(specs, 2) == specs[:2]
    tiled = take(specs, 7)
    # period = span (3 s) + mean gap (1.5 s)
    assert [s.arrival_s for s in tiled] == [0.0, 1.0, 3.0, 4.5, 5.5, 7.5, 9.0]
    assert [s.input_len for s in tiled] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(ValueError):
        take([], 1)
