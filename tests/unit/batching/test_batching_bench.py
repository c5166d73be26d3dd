"""`alignedserve bench batching` prints the documented JSON (tiny sizes: this checks shape, not speed)."""

from __future__ import annotations

import json

import pytest

from alignedserve.bench import batching as bench


def test_bench_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--json",
        "--sizes",
        "300,600",
        "--ops",
        "20",
        "--forms",
        "3",
        "--compare",
        "--oracle-samples",
        "2",
    ]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [row["waiting"] for row in out["results"]] == [300, 600]
    for row in out["results"]:
        for key in ("insert_p99_us", "remove_p99_us", "form_p50_ms", "form_p99_ms"):
            assert row[key] > 0
        assert row["policy"] == "aligned" and row["oracle_samples"] == 2
        assert (
            row["spread_excess_max"] >= 0
        )  # no set of as many requests that fits is narrower than the oracle
    assert sorted({row["policy"] for row in out["compare"]}) == ["fcfs", "window"]


def test_bench_rejects_bad_sizes() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "ten"])
