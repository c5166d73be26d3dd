"""`make bench-e2e`: the paper's experiment on this stack — aligned vs fcfs vs aligned without prefetch.

In one run, the whole stack (`alignedserve up`) is brought up in each mode in turn; the same workloads
(the 95%-short synthetic mix and the Azure conversation trace, scaled to this machine) are replayed
through the load generator; the services' /metrics are read before and after each workload for
decode-side stats. The table, the ratios and the plots go into `docs/benchmarks.md` between
`<!-- bench-e2e:begin -->` and `<!-- bench-e2e:end -->`.

    python -m alignedserve.bench.e2e.experiment --out docs/benchmarks.md --json bench-e2e.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alignedserve.bench.e2e.doc import (
    fmt,
    fmt_ratio,
    markdown_table,
    relative_link,
    safe_ratio,
    write_section,
)
from alignedserve.bench.e2e.plots import compare_cdfs
from alignedserve.bench.e2e.runs import (
    BenchWorkload,
    RunRow,
    RunScale,
    Target,
    row_from,
    run_workload,
    select_workloads,
)
from alignedserve.bench.e2e.servers import ServerProcess, ServerStartError, free_port
from alignedserve.core.cpu_layout import check_layout
from alignedserve.engine.config import host_cpu_layout
from alignedserve.loadgen.records import RequestRecord
from alignedserve.loadgen.scrape import busy_shares, counter_delta, decode_stats, prefill_stats, scrape

SECTION = "bench-e2e"


@dataclass(frozen=True, slots=True)
class StackMode:
    """One configuration of the stack under test."""

    name: str  # id in JSON and on the command line
    label: str  # row label in the table
    policy: str  # the batcher's batch-formation policy
    prefetch: bool  # KV moves toward decode ahead of time (`up --prefetch auto`), or not (off)
    cpu_layout: str = "auto"  # alignedserve.core.cpu_layout: where the CPU engines run

    def up_args(self) -> list[str]:
        prefetch = "auto" if self.prefetch else "off"
        return ["--policy", self.policy, "--prefetch", prefetch, "--cpu-layout", self.cpu_layout]


MODES = {
    m.name: m
    for m in (
        StackMode("aligned", "aligned", "aligned", True),
        StackMode("fcfs", "fcfs", "fcfs", True),
        StackMode("aligned-noprefetch", "aligned, prefetch off", "aligned", False),
    )
}


@dataclass(frozen=True, slots=True)
class StackLaunch:
    """How `alignedserve up` is started for every mode."""

    log_dir: Path
    bus: str | None = None  # None: the launcher's default (local Redis, started if absent)
    prefill: int = 1
    decode: int = 1
    dtype: str = "float32"
    metrics_base_port: int = 9100
    ready_timeout_s: float = 900.0

    def server(self, mode: StackMode, port: int) -> ServerProcess:
        argv = [sys.executable, "-m", "alignedserve.core.cli", "up", "--port", str(port), *mode.up_args()]
        argv += ["--prefill", str(self.prefill), "--decode", str(self.decode), "--dtype", self.dtype]
        argv += [
            "--metrics-base-port",
            str(self.metrics_base_port),
            "--log-dir",
            str(self.log_dir / mode.name),
        ]
        if self.bus is not None:
            argv += ["--bus", self.bus]
        return ServerProcess(
            name=f"alignedserve-{mode.name}",
            argv=argv,
            base_url=f"http://127.0.0.1:{port}",
            log_path=self.log_dir / f"up-{mode.name}.log",
            env={"HF_HUB_OFFLINE": "1"},
            ready_line="AlignedServe ready:",
            ready_timeout_s=self.ready_timeout_s,
        )

    def metrics_urls(self, mode: StackMode) -> list[str]:
        """kvpool, batcher, the prefill and the decode workers, then the prefill workers the mode's CPU
        layout adds: `alignedserve up`'s port order."""
        spill = host_cpu_layout(mode.cpu_layout, self.dtype)[0].spill_workers
        count = 2 + self.prefill + self.decode + spill
        return [
            f"http://127.0.0.1:{p}/metrics"
            for p in range(self.metrics_base_port, self.metrics_base_port + count)
        ]


@dataclass
class RunSet:
    """Rows and the raw records (for the plots) of every (target, workload)."""

    rows: list[RunRow]
    records: dict[tuple[str, str], list[RequestRecord]]

    def row(self, target: str, workload: str) -> RunRow | None:
        return next((r for r in self.rows if r.target == target and r.workload == workload), None)


def run_stack_modes(
    modes: Sequence[StackMode], workloads: Sequence[BenchWorkload], scale: RunScale, launch: StackLaunch
) -> tuple[RunSet, list[str]]:
    """Every workload through the stack in each mode; returns the runs and the modes that did not start."""
    runs, failed = RunSet([], {}), []
    for mode in modes:
        port = free_port()
        print(f"[bench-e2e] starting the stack: {mode.label} (port {port})", file=sys.stderr, flush=True)
        try:
            with launch.server(mode, port) as server:
                print(f"[bench-e2e] ready after {server.ready_after_s:.0f} s", file=sys.stderr, flush=True)
                run_mode(mode, Target(mode.label, server.base_url), workloads, scale, launch, runs)
        except ServerStartError as e:
            print(f"[bench-e2e] {e}", file=sys.stderr, flush=True)
            failed.append(f"{mode.label}: the stack did not start ({str(e).splitlines()[0]})")
    return runs, failed


def run_mode(
    mode: StackMode,
    target: Target,
    workloads: Sequence[BenchWorkload],
    scale: RunScale,
    launch: StackLaunch,
    runs: RunSet,
) -> None:
    for workload in workloads:
        before = scrape(launch.metrics_urls(mode))
        result = run_workload(target, workload, scale)
        delta = counter_delta(before, scrape(launch.metrics_urls(mode)))
        stats = {**decode_stats(delta), **prefill_stats(delta)}
        stats.update(busy_shares(stats, result.summary.duration_s))
        runs.rows.append(row_from(mode.name, workload.name, result, stats))
        runs.records[(mode.name, workload.name)] = result.records


# ---- ratios and the markdown section (pure) ----


def mode_ratios(runs: RunSet, workload: str) -> dict[str, float | None]:
    """aligned vs fcfs and prefetch on vs off, from one workload's rows (None where a row is missing)."""
    prefetch = pair_ratios(runs, workload, "aligned", "aligned-noprefetch")
    return {
        **pair_ratios(runs, workload, "aligned", "fcfs"),
        "throughput_prefetch_on_over_off": prefetch["throughput_aligned_over_aligned-noprefetch"],
    }


def pair_ratios(runs: RunSet, workload: str, first: str, second: str) -> dict[str, float | None]:
    """Mode `first` against `second`: each ratio > 1 where `first` did better, except mean TTFT."""

    def ratio(key: str, top: str, bottom: str) -> float | None:
        a, b = runs.row(top, workload), runs.row(bottom, workload)
        return None if a is None or b is None else safe_ratio(a.get(key), b.get(key))

    return {
        f"throughput_{first}_over_{second}": ratio("output_throughput", first, second),
        f"p99_tpot_{second}_over_{first}": ratio("p99_tpot_ms", second, first),
        f"mean_ttft_{first}_over_{second}": ratio("mean_ttft_ms", first, second),
    }


def pair_labels(first: str, second: str) -> dict[str, str]:
    """pair_ratios' keys -> what the table calls them."""
    return {
        f"throughput_{first}_over_{second}": f"{first} ÷ {second} output tok/s",
        f"p99_tpot_{second}_over_{first}": f"{second} ÷ {first} P99 TPOT",
        f"mean_ttft_{first}_over_{second}": f"{first} ÷ {second} mean TTFT",
    }


RESULT_HEADERS = [
    "workload",
    "mode",
    "done / failed",
    "output tok/s",
    "req/s",
    "TTFT mean ms",
    "TTFT p99 ms",
    "TPOT mean ms",
    "TPOT p99 ms",
    "ITL p99 ms",
]


def result_cells(row: RunRow, workload_title: str, target_label: str) -> list[str]:
    return [
        workload_title,
        target_label,
        f"{row.summary.get('completed', 0)} / {row.summary.get('failed', 0)}",
        fmt(row.get("output_throughput")),
        fmt(row.get("request_throughput"), 2),
        fmt(row.get("mean_ttft_ms"), 0),
        fmt(row.get("p99_ttft_ms"), 0),
        fmt(row.get("mean_tpot_ms")),
        fmt(row.get("p99_tpot_ms")),
        fmt(row.get("p99_itl_ms")),
    ]


# server-side stats shown as extra columns when some row measured them: (stat, header, scale)
SERVER_COLUMNS = (
    ("mixed_iteration_fraction", "mixed iterations %", 100.0),
    ("decode_busy_tokens_per_s", "decode tok/s while busy", 1.0),
    ("mean_decode_iteration_ms", "decode iteration mean ms", 1.0),
    ("mean_decode_prefix_spread", "running-batch prefix spread (tokens)", 1.0),
    ("prefill_busy_tokens_per_s", "prefill tok/s while busy", 1.0),
    ("prefill_busy_share", "prefill busy %", 100.0),
    ("decode_busy_share", "decode busy %", 100.0),
)


def results_table(
    runs: RunSet, workloads: Sequence[BenchWorkload], labels: dict[str, str]
) -> tuple[str, bool]:
    """The per-(workload, mode) table, with a server-stat column for each stat some row measured.
    Returns (table, whether the mixed-iteration column is present)."""
    shown = [c for c in SERVER_COLUMNS if any(c[0] in r.server_stats for r in runs.rows)]
    headers = RESULT_HEADERS + [header for _, header, _ in shown]
    cells = []
    for workload in workloads:
        for target, label in labels.items():
            row = runs.row(target, workload.name)
            if row is None:
                continue
            line = result_cells(row, workload.title, label)
            for stat, _, factor in shown:
                value = row.server_stats.get(stat)
                line.append(fmt(None if value is None else factor * value))
            cells.append(line)
    return markdown_table(headers, cells, text_columns=2), any(
        c[0] == "mixed_iteration_fraction" for c in shown
    )


def ratios_table(runs: RunSet, workloads: Sequence[BenchWorkload]) -> str:
    headers = [
        "workload",
        "aligned ÷ fcfs output tok/s (target ≥ 1.3×)",
        "fcfs ÷ aligned P99 TPOT (target ≥ 2×)",
        "TTFT cost: aligned ÷ fcfs mean TTFT",
        "prefetch on ÷ off output tok/s",
    ]
    cells = []
    for workload in workloads:
        r = mode_ratios(runs, workload.name)
        cells.append(
            [
                workload.title,
                fmt_ratio(r["throughput_aligned_over_fcfs"]),
                fmt_ratio(r["p99_tpot_fcfs_over_aligned"]),
                fmt_ratio(r["mean_ttft_aligned_over_fcfs"]),
                fmt_ratio(r["throughput_prefetch_on_over_off"]),
            ]
        )
    return markdown_table(headers, cells)


def render_section(
    runs: RunSet,
    workloads: Sequence[BenchWorkload],
    modes: Sequence[StackMode],
    scale: RunScale,
    command: str,
    plots: Sequence[Path],
    doc_dir: Path,
    when: str,
    failed: Sequence[str] = (),
) -> str:
    table, with_mixed = results_table(runs, workloads, {m.name: m.label for m in modes})
    parts = [
        "## End to end: aligned vs fcfs vs prefetch off",
        "",
        f"Measured {when} with `{command}` (SmolLM2-135M-Instruct, CPU): {scale.describe()}. "
        "Every mode replays the same requests; TPOT excludes the first token; output tok/s counts "
        "completed requests' tokens over the run's wall time.",
        "",
        table,
        "",
        ratios_table(runs, workloads),
    ]
    if not with_mixed:
        parts += [
            "",
            "The mixed-iteration fraction is left out: the decode workers' /metrics gave no "
            "`alignedserve:decode_iterations_total` / `alignedserve:decode_mixed_iterations_total` in this run.",
        ]
    if failed:
        parts += ["", *(f"Not measured: {f}" for f in failed)]
    parts += [""] + [f"![{p.stem}]({relative_link(p, doc_dir)})" for p in plots]
    return "\n".join(parts)


# ---- command line ----


def add_scale_args(p: argparse.ArgumentParser) -> None:
    d = RunScale()
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="requests per workload")
    p.add_argument("--length-scale", type=float, default=d.length_scale, help="multiply every length")
    p.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="closed loop (or cap with --request-rate)"
    )
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-input-len", type=int, default=d.max_input_len)
    p.add_argument("--max-output-len", type=int, default=d.max_output_len)
    p.add_argument("--workloads", default=None, help="comma-separated: synthetic95,azure-conv (default both)")


def scale_from(a: argparse.Namespace) -> RunScale:
    return RunScale(
        num_requests=a.num_requests,
        length_scale=a.length_scale,
        concurrency=a.concurrency,
        request_rate=a.request_rate,
        seed=a.seed,
        max_input_len=a.max_input_len,
        max_output_len=a.max_output_len,
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m alignedserve.bench.e2e.experiment",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"), help="markdown file to update")
    p.add_argument("--img-dir", type=Path, default=Path("docs/img/bench-e2e"), help="where the PNGs go")
    p.add_argument("--json", type=Path, default=None, help="also write every result as one JSON object")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    p.add_argument("--bus", default=None, help="control bus URL for `alignedserve up` (default: local Redis)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--metrics-base-port", type=int, default=9100)
    p.add_argument("--log-dir", type=Path, default=Path("var/log/bench-e2e"))
    add_scale_args(p)
    return p.parse_args(argv)


def json_report(
    runs: RunSet, workloads: Sequence[BenchWorkload], scale: RunScale, extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        **extra,
        "scale": asdict(scale),
        "runs": [asdict(r) for r in runs.rows],
        "ratios": {w.name: mode_ratios(runs, w.name) for w in workloads},
    }


def parse_modes(text: str) -> list[StackMode]:
    """`aligned,fcfs` -> those modes; `MODE@LAYOUT` runs a mode with that CPU layout (`aligned@split`).
    ValueError naming the unknown ones."""
    names = text.split(",")
    unknown = [m for m in names if m.partition("@")[0] not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(MODES)}, each optionally @LAYOUT")
    return [_mode(name) for name in names]


def _mode(name: str) -> StackMode:
    base, _, layout = name.partition("@")
    if not layout:
        return MODES[base]
    check_layout(layout)
    mode = MODES[base]
    return replace(mode, name=name, label=f"{mode.label}, {layout} cores", cpu_layout=layout)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    try:
        scale = scale_from(a)
        workloads = select_workloads(scale, a.workloads.split(",") if a.workloads else None)
        modes = parse_modes(a.modes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    launch = StackLaunch(a.log_dir, a.bus, a.prefill, a.decode, a.dtype, a.metrics_base_port)
    runs, failed = run_stack_modes(modes, workloads, scale, launch)
    if not runs.rows:
        print("error: no mode of the stack started; docs left unchanged", file=sys.stderr)
        return 1
    plots = [
        compare_cdfs(
            {m.label: runs.records.get((m.name, w.name), []) for m in modes},
            f"{w.title}: AlignedServe modes",
            a.img_dir / f"{w.name}-modes.png",
        )
        for w in workloads
    ]
    command = "python -m alignedserve.bench.e2e.experiment " + shlex.join(argv)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    write_section(
        a.out,
        SECTION,
        render_section(runs, workloads, modes, scale, command, plots, a.out.parent, when, failed),
    )
    if a.json is not None:
        a.json.write_text(
            json.dumps(
                json_report(runs, workloads, scale, {"command": command, "date": when, "failed": failed}),
                indent=2,
            )
        )
    print(json.dumps({w.name: mode_ratios(runs, w.name) for w in workloads}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
