"""The stack bench: its pure parts (marks, rates, report, URL) and one tiny real run
(random-weight Llama, real Redis at REDIS_URL, real UCX endpoints, the real decode worker loop)."""

from __future__ import annotations

import json

import pytest

from alignedserve.bench.stack import (
    Mark,
    RoundResult,
    bench_bus_url,
    forward_share,
    loop_overheads,
    main,
    parse_args,
    report,
    steady_marks,
    tokens_per_s,
)


def test_steady_marks_keep_full_iterations_after_warmup() -> None:
    marks = [Mark(0.0, 2, 0.1), Mark(1.0, 4, 0.1), Mark(2.0, 4, 0.1), Mark(3.0, 4, 0.1), Mark(4.0, 3, 0.1)]
    assert steady_marks(marks, batch=4, warmup=1) == marks[2:4]


def test_tokens_per_s_counts_tokens_after_the_first_mark() -> None:
    marks = [Mark(10.0, 4, 0.0), Mark(10.5, 4, 0.0), Mark(11.0, 4, 0.0)]
    assert tokens_per_s(marks) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="at least 2"):
        tokens_per_s(marks[:1])
    with pytest.raises(ValueError, match="increase"):
        tokens_per_s([Mark(1.0, 4, 0.0), Mark(1.0, 4, 0.0)])


def test_loop_overheads_are_period_minus_step() -> None:
    marks = [Mark(0.0, 4, 0.1), Mark(0.12, 4, 0.1), Mark(0.25, 4, 0.11)]
    assert loop_overheads(marks) == pytest.approx([0.02, 0.02])


def test_forward_share_is_step_time_over_period() -> None:
    marks = [Mark(0.0, 4, 0.1), Mark(0.2, 4, 0.15), Mark(0.4, 4, 0.15)]
    assert forward_share(marks) == pytest.approx(0.75)


def test_report_takes_medians_of_rounds_and_pools_samples() -> None:
    rounds = [
        RoundResult(100.0, 90.0, [0.001, 0.002], [0.003], [0.0001], [0.004], 0.99),
        RoundResult(120.0, 60.0, [0.004], [0.005], [0.0002], [], 0.98),
        RoundResult(110.0, 99.0, [0.003], [0.001], [0.0001], [0.002], 0.97),
    ]
    out = report(rounds, {"batch": 4})
    assert out["engine_tok_s"] == 110.0
    assert out["stack_tok_s"] == 90.0
    assert out["ratio"] == 0.9  # median of 0.9, 0.5, 0.9
    # pooled [1, 2, 4, 3] ms, linear between closest ranks: p50 rank 1.5 -> 2.5; p99 rank 2.97 -> 3.97
    assert out["sched_bus_p50_ms"] == 2.5
    assert out["sched_bus_p99_ms"] == 3.97
    assert out["sched_bus_samples"] == 4
    assert out["stack_forward_share"] == 0.98
    assert out["batch"] == 4
    assert len(out["rounds"]) == 3
    with pytest.raises(ValueError):
        report([], {})


def test_bench_bus_url_uses_its_own_database() -> None:
    assert bench_bus_url("redis://h:6379/0") == "redis://h:6379/14?block_ms=100"
    assert (
        bench_bus_url("redis://h:6379/3?maxlen=10&block_ms=5", 2) == "redis://h:6379/2?maxlen=10&block_ms=100"
    )
    with pytest.raises(ValueError, match="redis"):
        bench_bus_url("kafka://h:9092")


def test_parse_args_rejects_bad_sizes_and_derives_max_tokens() -> None:
    args = parse_args(["--iterations", "8", "--warmup", "2"])
    assert args.max_tokens == 1 + 2 + 8 + 1
    with pytest.raises(SystemExit):
        parse_args(["--batch", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--warmup", "-1"])
    with pytest.raises(SystemExit):
        parse_args(["--bus", "kafka://127.0.0.1:9092"])


TEST_DB = 15  # not the bench's own database: a test run never flushes a benchmark that is running


def test_tiny_run_prints_the_report(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--tiny", "--batch", "3", "--prefix", "20", "--iterations", "3", "--warmup", "1",
            "--rounds", "1", "--block-size", "4", "--bus", redis_url, "--bus-db", str(TEST_DB)]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny-llama"
    assert (out["batch"], out["prefix"], out["iterations"]) == (3, 20, 3)
    assert out["engine_tok_s"] > 0 and out["stack_tok_s"] > 0
    # the report rounds the ratio to 4 decimals: a slow round (ratio ~0.008) leaves it 0.5 % off
    assert out["ratio"] == pytest.approx(out["stack_tok_s"] / out["engine_tok_s"], rel=1e-3, abs=5e-5)
    # every stack iteration observed its scheduling + bus time: warmup + iterations + 1 decode steps
    assert out["sched_bus_samples"] == 1 + 3 + 1
    assert 0 < out["stack_forward_share"] <= 1
    assert 0 < out["sched_bus_p50_ms"] <= out["sched_bus_p99_ms"] <= out["sched_bus_max_ms"]
