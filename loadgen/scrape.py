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

# The batcher's histogram of (max - min) prefix length over each formed batch: how aligned batches are.
SPREAD = "alignedserve:batcher_batch_prefix_spread_tokens"

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


def _is_mixed(name: str) -> bool:
    return "mixed" in name or "switch" in name


def decode_stats(delta: Mapping[str, float]) -> dict[str, float]:
    """Iteration counts and the mixed-iteration fraction over a run, when the counters exist."""
    iterations = mixed = 0.0
    found_iterations = found_mixed = False
    for key, value in delta.items():
        name = _base_name(key)
        if not name.endswith("iterations_total"):
            continue
        if _is_mixed(name):
            mixed += value
            found_mixed = True
        else:
            iterations += value
            found_iterations = True
    stats: dict[str, float] = {}
    if found_iterations:
        stats["decode_iterations"] = iterations
    if found_mixed:
        stats["mixed_iterations"] = mixed
    if found_iterations and found_mixed and iterations > 0:
        stats["mixed_iteration_fraction"] = mixed / iterations
    spread_sum, spread_count = delta.get(SPREAD + "_sum"), delta.get(SPREAD + "_count")
    if spread_sum is not None and spread_count:
        stats["mean_batch_prefix_spread"] = spread_sum / spread_count
    return stats
