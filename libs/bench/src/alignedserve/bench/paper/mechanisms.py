"""Why AlignedServe's advantage here is smaller than the paper's, read off the simulated iterations.

Alignment can only remove the bubble (attention time beyond reading every KV byte at full bandwidth);
everything else a decode token costs is the same whatever the batching. So a baseline's bubble share
bounds what AlignedServe can gain over it, and AlignedServe's own residual bubble (mostly in the
iterations of a batch switch-over) bounds what a better switch-over could still gain.
"""

from __future__ import annotations

from alignedserve.bench.paper.experiments import ALIGNED, DISTSERVE, FCFS, System, decoding_instances
from alignedserve.bench.paper.fmt import Results, get, per_token_ms, table, x
from alignedserve.bench.paper.jobs import Summary
from alignedserve.bench.paper.motivation import checks

CASES = (
    ("synthetic 95 % short, OPT-2.7B", "synthetic/opt-2.7b/0.95", "opt-2.7b"),
    ("Azure, OPT-13B", "apps/opt-13b/azure", "opt-13b"),
    ("LongBench-like, OPT-13B", "apps/opt-13b/longbench", "opt-13b"),
)


def _busy_share(summary: Summary, key: str) -> float:
    return float(summary[key]) / (float(summary["time_decode_busy_s"]) or 1.0)


def _ceiling(results: Results, key: str, model: str, other: System) -> float:
    """AlignedServe ÷ `other` per decode token if alignment removed all of `other`'s bubble and nothing else
    differed: the most prefix-aware batching can buy under this cost model."""
    parts = per_token_ms(get(results, key, other), decoding_instances(other, model))
    total = sum(parts.values())
    return total / (total - parts["bubble"]) if total > parts["bubble"] else float("nan")


def _row(results: Results, label: str, key: str, model: str) -> list[str]:
    a, f = get(results, key, ALIGNED), get(results, key, FCFS)
    parts = per_token_ms(a, decoding_instances(ALIGNED, model))
    total = sum(parts.values()) or 1.0
    return [
        label,
        f"{parts['attention at full bandwidth'] / total * 100:.0f} %",
        f"{_busy_share(f, 'time_bubble_s') * 100:.1f} %",
        f"{_busy_share(get(results, key, DISTSERVE), 'time_bubble_s') * 100:.1f} %",
        f"{_busy_share(a, 'time_bubble_s') * 100:.1f} %",
        f"{_busy_share(a, 'time_bubble_misaligned_s') * 100:.1f} %",
        x(_ceiling(results, key, model, FCFS)),
        x(float(a["decode_throughput_tok_s"]) / float(f["decode_throughput_tok_s"])),
    ]


def mechanism_section(results: Results) -> str:
    body = [_row(results, *case) for case in CASES]
    fcfs_bubble = _busy_share(get(results, CASES[1][1], FCFS), "time_bubble_s")
    grouped = next(c for c in checks() if c.kind == "prediction" and c.model.endswith("paperfit"))
    return (
        "### Why the advantage is smaller than the paper's\n\n"
        "From the simulated iterations (shares of decoding time, offline runs). *Attention at full "
        "bandwidth* is the same for every system — the same KV is read — and dominates a memory-full "
        "decode iteration; prefix-aware batching can only remove the *bubble*. The baselines' bubble is "
        "therefore the ceiling of AlignedServe's gain (*ceiling*: fcfs's time per token without its "
        "bubble); the gain reached is next to it. What is left of AlignedServe's own bubble sits almost "
        "all in misaligned switch-over iterations.\n\n"
        + table(
            [
                "workload",
                "attention at full BW (AlignedServe)",
                "bubble, fcfs",
                "bubble, DistServe",
                "bubble, AlignedServe",
                "… in misaligned iterations",
                "ceiling ÷ fcfs",
                "reached ÷ fcfs",
            ],
            body,
        )
        + "\nSo the mechanism is a cost-model term, not a scheduler decision: on the Azure trace the cost model "
        f"gives fcfs's mixed batches a bubble of {fcfs_bubble * 100:.0f} % of decoding time (its fluid "
        "per-sequence bandwidth model also predicts the paper's second motivating measurement, mixed ÷ "
        f"grouped TPOT {x(grouped.paper)}, as {x(grouped.ours)}), while the paper's testbed showed +61 % for "
        "4 long prompts in 64. "
        "The scheduler decisions that remain — switch-over iterations that mix two batches, and the "
        "admit-then-evict thrash at the memory limit that `growth_reserve` removes — are each worth a few "
        "per cent at most under this model. The co-located baselines differ by a workload-independent "
        "factor as well: they decode on all 8 GPUs (the per-instance lens of the tables).\n"
    )
