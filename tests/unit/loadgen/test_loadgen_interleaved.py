"""The interleaved aligned-vs-fcfs driver's pure parts: round order, per-round ratios, median and range."""

from __future__ import annotations

import pytest

from alignedserve.bench.e2e.experiment import MODES, RunSet, parse_modes
from alignedserve.bench.e2e.interleaved import round_order, spread_of, summarize, summary_table
from alignedserve.bench.e2e.runs import RunRow, RunScale, select_workloads


def _round(aligned_tok_s: float, fcfs_tok_s: float) -> RunSet:
    def row(target: str, tok_s: float) -> RunRow:
        summary = {"output_throughput": tok_s, "p99_tpot_ms": 100.0, "mean_ttft_ms": 1000.0}
        return RunRow(target, "synthetic95", summary)

    return RunSet([row("aligned", aligned_tok_s), row("fcfs", fcfs_tok_s)], {})


def test_rounds_alternate_which_mode_goes_first() -> None:
    modes = [MODES["aligned"], MODES["fcfs"]]
    assert [m.name for m in round_order(modes, 0)] == ["aligned", "fcfs"]
    assert [m.name for m in round_order(modes, 1)] == ["fcfs", "aligned"]
    assert [m.name for m in round_order(modes, 2)] == ["aligned", "fcfs"]


def test_median_and_range_over_the_rounds_that_measured() -> None:
    assert spread_of([1.2, None, 0.9, 1.0]) == {"median": 1.0, "min": 0.9, "max": 1.2}
    assert spread_of([None]) == {"median": None, "min": None, "max": None}


def test_summary_gives_each_rounds_ratio_and_their_median() -> None:
    workloads = select_workloads(RunScale(num_requests=4), ["synthetic95"])
    summary = summarize([_round(110.0, 100.0), _round(90.0, 100.0), _round(102.0, 100.0)], workloads)
    tput = summary["synthetic95"]["throughput_aligned_over_fcfs"]
    assert tput["rounds"] == pytest.approx([1.1, 0.9, 1.02])
    assert tput["median"] == pytest.approx(1.02)
    assert (tput["min"], tput["max"]) == (pytest.approx(0.9), pytest.approx(1.1))
    assert summary["synthetic95"]["p99_tpot_fcfs_over_aligned"]["median"] == pytest.approx(1.0)
    table = summary_table(summary, workloads)
    assert "| synthetic, 95% short | aligned ÷ fcfs output tok/s | 1.02× | 0.900–1.100 |" in table


def test_a_mode_at_a_cpu_layout_is_that_mode_with_the_layout_passed_to_up() -> None:
    split, aligned = parse_modes("aligned@split,aligned")
    assert split.name == "aligned@split" and split.policy == "aligned" and split.prefetch
    assert split.up_args()[-2:] == ["--cpu-layout", "split"]
    assert aligned.up_args()[-2:] == ["--cpu-layout", "auto"]
    with pytest.raises(ValueError, match="choose auto or one of"):
        parse_modes("aligned@spread")
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("greedy@split")


def test_any_two_modes_compare_as_first_over_second() -> None:
    workloads = select_workloads(RunScale(num_requests=4), ["synthetic95"])
    rows = [
        RunRow("aligned@split", "synthetic95", {"output_throughput": 120.0, "p99_tpot_ms": 80.0, "mean_ttft_ms": 500.0}),
        RunRow("aligned@shared", "synthetic95", {"output_throughput": 100.0, "p99_tpot_ms": 100.0, "mean_ttft_ms": 1000.0}),
    ]  # fmt: skip
    pair = ("aligned@split", "aligned@shared")
    summary = summarize([RunSet(rows, {})], workloads, pair)["synthetic95"]
    assert summary["throughput_aligned@split_over_aligned@shared"]["median"] == pytest.approx(1.2)
    assert summary["p99_tpot_aligned@shared_over_aligned@split"]["median"] == pytest.approx(1.25)
    assert summary["mean_ttft_aligned@split_over_aligned@shared"]["median"] == pytest.approx(0.5)
    table = summary_table(summarize([RunSet(rows, {})], workloads, pair), workloads, pair)
    assert "| aligned@split ÷ aligned@shared output tok/s | 1.20× |" in table
