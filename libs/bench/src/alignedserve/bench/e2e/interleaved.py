"""Two modes of the same stack, interleaved: the median ratio over rounds, not one run's.

One run of each mode (`make bench-e2e`) compares two moments of a shared machine; a ratio near 1.0 is
then within the noise. Here every round brings the stack up in each mode in turn, in alternating
order (aligned, fcfs, fcfs, aligned, ...: a drift in the machine's load hits both alike), replays the
same workloads, and the per-round ratios are reported with their median and range.

    python -m alignedserve.bench.e2e.interleaved --rounds 3 --num-requests 24 --json out.json
    python -m alignedserve.bench.e2e.interleaved --modes aligned@prefill-yields,aligned@shared  # CPU layouts

Nothing is written into the docs; the JSON holds every run's summary and the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from alignedserve.bench.e2e.doc import fmt, fmt_ratio, markdown_table
from alignedserve.bench.e2e.experiment import (
    MODES,
    RunSet,
    StackLaunch,
    add_scale_args,
    pair_labels,
    pair_ratios,
    parse_modes,
    run_stack_modes,
    scale_from,
)
from alignedserve.bench.e2e.runs import BenchWorkload, RunScale, select_workloads

T = TypeVar("T")

ALIGNED_VS_FCFS = ("aligned", "fcfs")


def round_order(contenders: Sequence[T], round_index: int) -> list[T]:
    """Even rounds in the given order, odd rounds reversed (ABBA), so neither one always goes first."""
    return list(contenders) if round_index % 2 == 0 else list(reversed(contenders))


def spread_of(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median, min and max of the rounds that gave a value (None when none did)."""
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(known), "min": min(known), "max": max(known)}


def summarize(
    rounds: Sequence[RunSet], workloads: Sequence[BenchWorkload], pair: tuple[str, str] = ALIGNED_VS_FCFS
) -> dict[str, Any]:
    """Per workload: each ratio of the pair's modes per round, and its median and range over the rounds."""
    out: dict[str, Any] = {}
    for workload in workloads:
        per_round = [pair_ratios(runs, workload.name, *pair) for runs in rounds]
        out[workload.name] = {
            key: {"rounds": [r[key] for r in per_round], **spread_of([r[key] for r in per_round])}
            for key in pair_labels(*pair)
        }
    return out


def summary_table(
    summary: dict[str, Any], workloads: Sequence[BenchWorkload], pair: tuple[str, str] = ALIGNED_VS_FCFS
) -> str:
    cells = []
    for workload in workloads:
        for key, label in pair_labels(*pair).items():
            s = summary[workload.name][key]
            rounds = ", ".join(fmt(v, 3) for v in s["rounds"])
            span = f"{fmt(s['min'], 3)}–{fmt(s['max'], 3)}"
            cells.append([workload.title, label, fmt_ratio(s["median"]), span, rounds])
    return markdown_table(["workload", "ratio", "median", "range", "per round"], cells, text_columns=2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m alignedserve.bench.e2e.interleaved",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=3, help="times each mode runs (alternating order)")
    p.add_argument(
        "--modes", default="aligned,fcfs", help=f"two of {','.join(MODES)}, each optionally @LAYOUT"
    )
    p.add_argument("--json", type=Path, default=None, help="write every run and the ratios here")
    p.add_argument("--bus", default=None, help="control bus URL for `alignedserve up` (default: local Redis)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--metrics-base-port", type=int, default=9100)
    p.add_argument("--log-dir", type=Path, default=Path("var/log/bench-e2e-interleaved"))
    add_scale_args(p)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    try:
        if a.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {a.rounds}")
        scale = scale_from(a)
        workloads = select_workloads(scale, a.workloads.split(",") if a.workloads else None)
        modes = parse_modes(a.modes)
        if len(modes) != 2:
            raise ValueError(f"--modes takes two modes, got {len(modes)}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    launch = StackLaunch(a.log_dir, a.bus, 1, 1, a.dtype, a.metrics_base_port)
    command = "python -m alignedserve.bench.e2e.interleaved " + shlex.join(argv)
    pair = (modes[0].name, modes[1].name)
    rounds: list[RunSet] = []
    failed: list[str] = []
    for index in range(a.rounds):
        print(f"[interleaved] round {index + 1}/{a.rounds}", file=sys.stderr, flush=True)
        runs, not_started = run_stack_modes(round_order(modes, index), workloads, scale, launch)
        rounds.append(runs)
        failed += [f"round {index + 1}: {f}" for f in not_started]
        if a.json is not None:  # after every round: a run cut short still leaves the rounds it finished
            report = json_report(command, scale, rounds, workloads, failed, pair)
            a.json.write_text(json.dumps(report, indent=2))
    table = summary_table(summarize(rounds, workloads, pair), workloads, pair)
    print(f"{command}\n{scale.describe()}\n\n{table}")
    return 1 if failed else 0


def json_report(
    command: str,
    scale: RunScale,
    rounds: Sequence[RunSet],
    workloads: Sequence[BenchWorkload],
    failed: list[str],
    pair: tuple[str, str],
) -> dict[str, Any]:
    return {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "scale": asdict(scale),
        "failed": failed,
        "ratios": summarize(rounds, workloads, pair),
        "runs": [[asdict(r) for r in runs.rows] for runs in rounds],
    }


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
