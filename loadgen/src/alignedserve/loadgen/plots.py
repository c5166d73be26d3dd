"""PNG plots of a run (matplotlib, headless Agg backend): TTFT CDF, TPOT CDF, throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display in a container or CI job
import matplotlib.pyplot as plt

from alignedserve.loadgen.metrics import output_tokens_over_time, tpot_s
from alignedserve.loadgen.records import RequestRecord


def _cdf(values_ms: list[float], title: str, xlabel: str, path: Path, slo_ms: float | None) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    ordered = sorted(values_ms)
    if ordered:
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post")
    else:
        ax.text(0.5, 0.5, "no completed request measured this", ha="center", transform=ax.transAxes)
    if slo_ms is not None:
        ax.axvline(slo_ms, color="tab:red", linestyle="--", label=f"SLO {slo_ms:g} ms")
        ax.legend(loc="lower right")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _throughput(records: Sequence[RequestRecord], path: Path) -> None:
    duration = max((r.end_s or 0.0 for r in records), default=0.0)
    bin_s = max(duration / 60.0, 0.25)  # about 60 bars whatever the run's length
    starts, rates = output_tokens_over_time(records, bin_s)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([t + bin_s / 2 for t in starts], rates, drawstyle="steps-mid")
    ax.set(
        title=f"Output throughput ({bin_s:.2g} s bins)",
        xlabel="time since start (s)",
        ylabel="output tokens/s",
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(
    records: Sequence[RequestRecord],
    out_dir: Path,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> list[Path]:
    """ttft_cdf.png, tpot_cdf.png, throughput.png in `out_dir` (created); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.ok]
    ttfts = [r.ttft_s * 1000.0 for r in done if r.ttft_s is not None]
    tpots = [t * 1000.0 for t in (tpot_s(r) for r in done) if t is not None]
    paths = [out_dir / "ttft_cdf.png", out_dir / "tpot_cdf.png", out_dir / "throughput.png"]
    _cdf(ttfts, "Time to first token", "TTFT (ms)", paths[0], slo_ttft_ms)
    _cdf(tpots, "Time per output token (after the first)", "TPOT (ms)", paths[1], slo_tpot_ms)
    _throughput(records, paths[2])
    return paths
