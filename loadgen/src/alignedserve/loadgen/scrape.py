"""Server-side statistics from the services' Prometheus `/metrics`, taken before and after a run.

Counters are read as the difference over the run (the stack stays up between workloads). From the
decode workers' iteration counters comes the mixed-iteration fraction: the share of decode iterations
that ran a batch mixing requests of different formed batches (the paper's "batch switching"
iterations). A counter is an iteration counter when its name ends in `iterations_total`; it counts mixed
iterations when its name also says `mixed` or `switch`. Stats whose counters are absent are left out.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

# Names exported by the decode workers and the batcher (services/*/metrics.py).
ITERATIONS = "alignedserve:decode_iterations_total"
MIXED_ITERATIONS = "alignedserve:decode_mixed_iterations_total"  # running set spans 2+ batch ids
GENERATED_TOKENS = "alignedserve:decode_generation_tokens_total"
PREFILL_WAIT = "alignedserve:decode_prefill_wait_seconds_total"  # decode steps waiting for prefill forwards
ITERATION_SECONDS = "alignedserve:decode_iteration_seconds"  # histogram: one decode forward
DECODE_SPREAD = "alignedserve:decode_prefix_spread_tokens"  # histogram: max - min prefix, per iteration
BATCH_SPREAD = "alignedserve:batcher_batch_prefix_spread_tokens"  # histogram: per formed batch
ADMISSION_STALL = "alignedserve:decode_admission_stall_seconds"  # histogram: loop waiting to admit
PROMPT_TOKENS = "alignedserve:prompt_tokens_total"  # prefilled by the prefill workers
PREFILL_SECONDS = "alignedserve:prefill_forward_seconds"  # histogram: one prefill forward

Samples = dict[str, float]  # "name{label=value,...}" -> value, summed over the scraped endpoints


def parse_samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def scrape(urls: Iterable[str], timeout_s: float = 2.0) -> Samples:
    """Sum of every sample over the endpoints that answer (a service without /metrics is skipped)."""
    total: Samples = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                text = resp.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError):
            continue
        for key, value in parse_samples(text).items():
            total[key] = total.get(key, 0.0) + value
    return total


CUMULATIVE_SUFFIXES = ("_total", "_sum", "_count")  # counters, and histograms' running sum and count


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> Samples:
    """after - before for the cumulative samples (counters, histogram sums and counts) after the run."""
    return {
        k: v - before.get(k, 0.0) for k, v in after.items() if _base_name(k).endswith(CUMULATIVE_SUFFIXES)
    }


def _base_name(key: str) -> str:
    return key.split("{", 1)[0]


def _sum_of(delta: Mapping[str, float], name: str) -> float | None:
    """Sum over every label set of `name`; None when no endpoint exported it."""
    values = [v for k, v in delta.items() if _base_name(k) == name]
    return sum(values) if values else None


def _mean_of(delta: Mapping[str, float], histogram: str) -> float | None:
    total, count = _sum_of(delta, histogram + "_sum"), _sum_of(delta, histogram + "_count")
    return None if total is None or not count else total / count


def decode_stats(delta: Mapping[str, float]) -> dict[str, float]:
    """Decode-side stats of a run from the counter deltas; a stat whose metrics are absent is left out.

    mixed_iteration_fraction: mixed / all decode iterations; decode_busy_s: seconds the decode workers
    spent in forwards (summed over workers); decode_prefill_wait_s: seconds its steps waited for prefill
    forwards (the prefill-first CPU layout); decode_busy_tokens_per_s: tokens generated per such second
    (throughput without idle time); mean spreads in tokens.
    """
    iterations, mixed = _sum_of(delta, ITERATIONS), _sum_of(delta, MIXED_ITERATIONS)
    tokens, busy_s = _sum_of(delta, GENERATED_TOKENS), _sum_of(delta, ITERATION_SECONDS + "_sum")
    candidates = {
        "decode_iterations": iterations,
        "mixed_iterations": mixed,
        "mixed_iteration_fraction": None
        if iterations is None or mixed is None or not iterations
        else mixed / iterations,
        "decode_busy_s": busy_s,
        "decode_prefill_wait_s": _sum_of(delta, PREFILL_WAIT),
        "decode_busy_tokens_per_s": None if tokens is None or not busy_s else tokens / busy_s,
        "mean_decode_iteration_ms": _ms(_mean_of(delta, ITERATION_SECONDS)),
        "mean_decode_prefix_spread": _mean_of(delta, DECODE_SPREAD),
        "mean_batch_prefix_spread": _mean_of(delta, BATCH_SPREAD),
        "mean_admission_stall_ms": _ms(_mean_of(delta, ADMISSION_STALL)),
    }
    return {k: v for k, v in candidates.items() if v is not None}


def prefill_stats(delta: Mapping[str, float]) -> dict[str, float]:
    """Prefill-side stats of a run from the counter deltas (absent metrics are left out).

    prefill_busy_s: seconds the prefill workers spent in forwards (summed over workers);
    prefill_busy_tokens_per_s: prompt tokens prefilled per such second."""
    tokens, busy_s = _sum_of(delta, PROMPT_TOKENS), _sum_of(delta, PREFILL_SECONDS + "_sum")
    candidates = {
        "prefill_forwards": _sum_of(delta, PREFILL_SECONDS + "_count"),
        "prefill_busy_s": busy_s,
        "prefill_busy_tokens_per_s": None if tokens is None or not busy_s else tokens / busy_s,
    }
    return {k: v for k, v in candidates.items() if v is not None}


def busy_shares(stats: Mapping[str, float], duration_s: float) -> dict[str, float]:
    """Engine-seconds per second of the run: how much of a core each role's forwards kept busy (0.5:
    half of one core's time; summed over a role's workers, so above 1 with several)."""
    if duration_s <= 0:
        return {}
    roles = (("prefill", "prefill_busy_s"), ("decode", "decode_busy_s"))
    return {f"{role}_busy_share": stats[key] / duration_s for role, key in roles if key in stats}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
