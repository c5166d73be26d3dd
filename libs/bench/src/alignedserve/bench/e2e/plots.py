"""Comparison plots for the experiment drivers: one figure per workload, every target's CDFs overlaid."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt

from alignedserve.loadgen.metrics import tpot_s
from alignedserve.loadgen.records import RequestRecord


def _cdf_points(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def compare_cdfs(runs: Mapping[str, Sequence[RequestRecord]], title: str, path: Path) -> Path:
    """`path` (PNG): TPOT and TTFT CDFs (ms) of each labelled run, side by side."""
    fig, (ax_tpot, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in runs.items():
        done = [r for r in records if r.ok]
        tpots = [t * 1000.0 for t in (tpot_s(r) for r in done) if t is not None]
        ttfts = [r.ttft_s * 1000.0 for r in done if r.ttft_s is not None]
        if tpots:
            ax_tpot.step(*_cdf_points(tpots), where="post", label=label)
        if ttfts:
            ax_ttft.step(*_cdf_points(ttfts), where="post", label=label)
    for ax, name in ((ax_tpot, "TPOT (ms, after the first token)"), (ax_ttft, "TTFT (ms)")):
        ax.set(xlabel=name, ylabel="fraction of requests", ylim=(0, 1.02))
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
