"""Small formatting and lookup helpers shared by the report's sections."""

from __future__ import annotations

from collections.abc import Sequence

from alignedserve.bench.paper.experiments import System, decoding_instances
from alignedserve.bench.paper.jobs import Summary

Results = dict[str, Summary]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def x(value: float) -> str:
    return f"{value:.2f}×" if value == value else "n/a"  # NaN-safe


def pct(value: float) -> str:
    return f"{value * 100:.1f} %"


def num(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def get(results: Results, key: str, system: System) -> Summary:
    return results[f"{key}/{system.label}"]


def per_instance(results: Results, key: str, system: System, model: str) -> float:
    """Decode tokens/s per instance that decodes (the paper's lens: a decode instance's throughput)."""
    return float(get(results, key, system)["decode_throughput_tok_s"]) / decoding_instances(system, model)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# where a decode token's instance time goes (metrics.py `time_*_s`), in the order they are reported
COMPONENTS = (
    ("linear", "time_linear_s"),
    ("attention at full bandwidth", "time_attention_s"),
    ("bubble", "time_bubble_s"),
    ("prefill chunks in the pass", "time_interference_s"),
    ("prefill-only passes", "time_prefill_only_s"),
    ("KV-transfer stalls", "time_stall_s"),
)


def per_token_ms(summary: Summary, instances: int) -> dict[str, float]:
    """Instance-milliseconds per decode token by cause, idle (instances waiting for work) included."""
    tokens = float(summary["decode_tokens"]) or 1.0
    parts = {name: float(summary[key]) * 1e3 / tokens for name, key in COMPONENTS}
    total = float(summary["decode_span_s"]) * instances * 1e3 / tokens
    parts["idle"] = max(0.0, total - sum(parts.values()))
    return parts


def mechanism(
    aligned: Summary, other: Summary, other_instances: int, aligned_instances: int, name: str
) -> str:
    """The two causes where `other` spends most more time per decode token than AlignedServe."""
    mine, theirs = per_token_ms(aligned, aligned_instances), per_token_ms(other, other_instances)
    gaps = sorted(((theirs[k] - mine[k], k) for k in mine), reverse=True)
    top = [f"{k} +{gap:.3f} ms" for gap, k in gaps[:2] if gap > 0.0005]
    if not top:
        return f"{name} spends no more instance time per token than AlignedServe"
    return f"{name} per decode token: " + ", ".join(top) + " of instance time"
