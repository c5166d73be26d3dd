"""The human-readable summary printed at the end of a run (vLLM-style table)."""

from __future__ import annotations

from alignedserve.loadgen.runner import BenchmarkResult


def _row(name: str, value: object) -> str:
    shown = "n/a" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
    return f"{name:<42}{shown:>14}"


def format_summary(result: BenchmarkResult) -> str:
    data = result.summary.to_json()
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 10]
    for key, label in (
        ("completed", "Successful requests"),
        ("failed", "Failed requests"),
        ("duration", "Benchmark duration (s)"),
        ("total_input_tokens", "Total input tokens"),
        ("total_output_tokens", "Total generated tokens"),
        ("request_throughput", "Request throughput (req/s)"),
        ("request_goodput", "Request goodput (req/s)"),
        ("slo_attainment", "SLO attainment (share)"),
        ("output_throughput", "Output token throughput (tok/s)"),
        ("total_token_throughput", "Total token throughput (tok/s)"),
    ):
        lines.append(_row(label, data[key]))
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(
                _row(
                    f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {name.upper()} (ms)",
                    data[f"{stat}_{name}_ms"],
                )
            )
    for kind, count in sorted(result.summary.failures.items()):
        lines.append(_row(f"Failures: {kind}", count))
    for kind, count in sorted(result.warnings.items()):
        lines.append(_row(f"Warnings: {kind}", count))
    if result.config.gate.any:
        lines.append(_row("SLO gate", "passed" if result.passed else "MISSED"))
        lines += [f"  {miss.describe()}" for miss in result.gate_misses]
    lines.append("=" * 56)
    return "\n".join(lines)
