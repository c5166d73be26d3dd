"""The bus benchmark runs end to end and reports its figures as JSON (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from alignedserve.bench.bus import main


def test_bench_reports_latency_and_throughput(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--bus", redis_url, "--n", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    figures = report["results"]["redis"]
    assert set(figures) == {"url", "decode_status", "token_batch_128"}
    for name in ("decode_status", "token_batch_128"):
        row = figures[name]
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert row["msgs_per_s"] > 0 and row["bytes"] > 0
