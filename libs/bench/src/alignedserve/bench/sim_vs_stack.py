"""`alignedserve sim vs-stack`: the simulator's prediction for every row of a measured bench-e2e run.

    python -m alignedserve.bench.e2e.experiment --json var/bench-e2e.json      # measure the stack
    alignedserve sim vs-stack --bench-json var/bench-e2e.json                # markdown table
    alignedserve sim vs-stack --bench-json var/bench-e2e.json --json         # one JSON object

For each (mode, workload) row of the benchmark's JSON the simulator replays the same requests — the
run's `scale` rebuilt as a `RunScale`, the workload built by the load generator's code
(`standard_workloads` -> `core.workloads.build.build_specs`), so the lengths are identical for the same
seed — in the same closed loop (`concurrency`), with the mode's policy and prefetch setting, on the
stack's default configuration (`deployments.STACK`: 1 prefill + 1 decode worker, K_min 16, max batch
64, fill 0.85, aging 10 s) and the `cpu-smollm2` cost model. It reports measured vs predicted output tokens/s, P99 and
mean TPOT and mean TTFT (the load generator's definitions: `output_throughput_tok_s`,
`p99_client_tpot_ms`, ... of the simulator) and predicted / measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from alignedserve.core.workloads.arrivals import ClosedLoop
from alignedserve.core.workloads.build import build_specs
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.traces import TraceFormatError
from alignedserve.sim.cli import RunSpec, simulate
from alignedserve.sim.compute import COMPUTE
from alignedserve.sim.cost import CostModel
from alignedserve.sim.cost_registry import cost_model_names, make_cost_model
from alignedserve.sim.deployments import STACK, Deployment
from alignedserve.sim.records import SimulationError

# bench-e2e mode name -> (batch policy, prefetch): alignedserve.bench.e2e.experiment.MODES (a test checks)
STACK_MODES: dict[str, tuple[str, bool]] = {
    "aligned": ("aligned", True),
    "fcfs": ("fcfs", True),
    "aligned-noprefetch": ("aligned", False),
}

# (bench summary key, simulator summary key, column title)
METRICS: tuple[tuple[str, str, str], ...] = (
    ("output_throughput", "output_throughput_tok_s", "output tok/s"),
    ("p99_tpot_ms", "p99_client_tpot_ms", "P99 TPOT ms"),
    ("mean_tpot_ms", "mean_client_tpot_ms", "mean TPOT ms"),
    ("mean_ttft_ms", "mean_ttft_ms", "mean TTFT ms"),
)
TABLE_METRICS = 2  # the table shows the first two; the JSON has all


@dataclass(frozen=True, slots=True)
class BenchRow:
    mode: str
    workload: str
    summary: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Comparison:
    mode: str
    workload: str
    policy: str
    prefetch: bool
    measured: dict[str, float | None]  # by bench key
    predicted: dict[str, float]  # by bench key
    sim: dict[str, Any]  # the simulator's whole summary

    def ratio(self, key: str) -> float | None:
        """Predicted / measured (None without a measured value)."""
        measured = self.measured.get(key)
        return self.predicted[key] / measured if measured else None

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "workload": self.workload,
            "policy": self.policy,
            "prefetch": self.prefetch,
            "measured": self.measured,
            "predicted": self.predicted,
            "predicted_over_measured": {key: self.ratio(key) for key, _, _ in METRICS},
            "sim": self.sim,
        }


def read_bench(path: Path) -> tuple[dict[str, Any], list[BenchRow]]:
    """(the run's `scale`, its rows) from a bench-e2e JSON; ValueError naming the file otherwise."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        scale = dict(raw["scale"])
        rows = [BenchRow(str(r["target"]), str(r["workload"]), dict(r["summary"])) for r in raw["runs"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a bench-e2e JSON ({type(e).__name__}: {e})") from e
    return scale, rows


def workloads_for(scale: dict[str, Any]) -> tuple[int, dict[str, list[RequestSpec]]]:
    """(concurrency, workload name -> requests) exactly as the benchmark built them."""
    from alignedserve.bench.e2e.runs import RunScale, standard_workloads

    try:
        run_scale = RunScale(**scale)
    except TypeError as e:
        raise ValueError(f"bench scale {scale} is not a RunScale: {e}") from e
    if run_scale.request_rate is not None or run_scale.concurrency is None:
        raise ValueError("vs-stack replays closed-loop runs; this one used Poisson arrivals (request_rate)")
    specs = {w.name: build_specs(w.config) for w in standard_workloads(run_scale)}
    return run_scale.concurrency, specs


def predict(
    rows: list[BenchRow], scale: dict[str, Any], deployment: Deployment, cost: CostModel
) -> tuple[list[Comparison], list[str]]:
    """A simulated run per comparable row; the rows it could not replay, with why."""
    concurrency, workloads = workloads_for(scale)
    comparisons: list[Comparison] = []
    skipped: list[str] = []
    for row in rows:
        if row.mode not in STACK_MODES:
            skipped.append(f"{row.mode}/{row.workload}: not a stack mode ({', '.join(STACK_MODES)})")
            continue
        if row.workload not in workloads:
            skipped.append(f"{row.mode}/{row.workload}: unknown workload ({', '.join(workloads)})")
            continue
        policy, prefetch = STACK_MODES[row.mode]
        config = deployment.cluster_config(policy, prefetch, ClosedLoop(concurrency))
        run = RunSpec(policy, prefetch, config, deployment.starvation_s, deployment.max_len)
        sim = simulate(workloads[row.workload], cost, run)
        comparisons.append(
            Comparison(
                mode=row.mode,
                workload=row.workload,
                policy=policy,
                prefetch=prefetch,
                measured={bench: _number(row.summary.get(bench)) for bench, _, _ in METRICS},
                predicted={bench: float(sim[key]) for bench, key, _ in METRICS},
                sim=dict(sim),
            )
        )
    return comparisons, skipped


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def markdown_table(comparisons: list[Comparison]) -> str:
    header = ["workload", "mode"]
    for _, _, title in METRICS[:TABLE_METRICS]:
        header += [f"{title} measured", "predicted", "pred / meas"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in comparisons:
        cells = [c.workload, c.mode]
        for key, _, _ in METRICS[:TABLE_METRICS]:
            ratio = c.ratio(key)
            cells += [_fmt(c.measured[key]), _fmt(c.predicted[key]), "—" if ratio is None else f"{ratio:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def report(
    path: Path, deployment: Deployment, cost: CostModel, comparisons: list[Comparison], skipped: list[str]
) -> dict[str, Any]:
    return {
        "bench_json": str(path),
        "cost_model": cost.name,
        "deployment": {
            k: sorted(v) if isinstance(v, frozenset) else v for k, v in asdict(deployment).items()
        },
        "rows": [c.to_json() for c in comparisons],
        "skipped": skipped,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alignedserve sim vs-stack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--bench-json", type=Path, required=True, help="python -m alignedserve.bench.e2e.experiment --json"
    )
    p.add_argument("--cost-model", choices=cost_model_names(), default=STACK.cost_model)
    p.add_argument("--prefill-workers", type=int, default=STACK.prefill_workers, help="as the bench ran")
    p.add_argument("--decode-workers", type=int, default=STACK.decode_workers, help="as the bench ran")
    p.add_argument(
        "--compute",
        choices=sorted(COMPUTE),
        default=STACK.compute,
        help="shared: the engines split one machine's cores, as the bench ran; dedicated: a device each",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out-json", type=Path, help="also write the JSON object here")
    return p


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.prefill_workers < 1 or args.decode_workers < 1:
        parser.error("--prefill-workers and --decode-workers must be >= 1")
    deployment = replace(
        STACK,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        cost_model=args.cost_model,
        compute=args.compute,
    )
    try:
        scale, rows = read_bench(args.bench_json)
        cost = make_cost_model(deployment.cost_model)
        comparisons, skipped = predict(rows, scale, deployment, cost)
    except (TraceFormatError, FileNotFoundError, ValueError, SimulationError) as e:
        print(f"alignedserve sim vs-stack: error: {e}", file=sys.stderr)
        return 2
    result = report(args.bench_json, deployment, cost, comparisons, skipped)
    if args.out_json is not None:
        args.out_json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result))
    else:
        print(markdown_table(comparisons), end="")
        for line in skipped:
            print(f"skipped: {line}", file=sys.stderr)
    return 0
