"""`alignedserve sim`: replay a workload through a simulated cluster driven by the real batching code.

alignedserve sim --workload synthetic --short-share 0.95 --requests 4000 --json
alignedserve sim --trace libs/alignedserve/data/traces/AzureLLMInferenceTrace_conv.csv --time-scale 0.1
alignedserve sim --workload azure --requests 100000 --json      # the trace tiled (workloads.take)
alignedserve sim --compare --workload synthetic --short-share 0.95   # aligned vs fcfs vs prefetch off
alignedserve sim calibrate --help                                 # refit the CPU cost model
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from alignedserve.batching.policies import POLICY_NAMES, make_policy
from alignedserve.batching.scheduler import plan_iteration
from alignedserve.sim.cluster import Cluster, ClusterConfig
from alignedserve.sim.cost import CostModel, cost_model_names, make_cost_model
from alignedserve.sim.records import SimulationError
from alignedserve.workloads import (
    RequestSpec,
    TraceFormatError,
    default_trace_path,
    longbench_like,
    read_trace,
    scale_time,
    sharegpt_like,
    synthetic,
    take,
    with_poisson_arrivals,
)

WORKLOADS = ("synthetic", "azure", "sharegpt", "longbench")
DEFAULT_SYNTHETIC_REQUESTS = 2000
# K_min: the paper's example saturating batch for prefix-aware policies; FCFS admits as memory frees
DEFAULT_MIN_BATCH = {"aligned": 128, "window": 128, "fcfs": 1}


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One simulated configuration."""

    policy: str
    prefetch: bool
    config: ClusterConfig
    starvation_s: float | None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alignedserve sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload", choices=WORKLOADS, default="synthetic", help="generator (ignored with --trace)"
    )
    w.add_argument(
        "--trace", type=Path, help="Azure-format CSV or JSONL (timestamp ms, input_length, output_length)"
    )
    w.add_argument(
        "--short-share", type=float, default=0.95, help="synthetic: share of prompts < 1000 tokens"
    )
    w.add_argument("--requests", type=int, help="first N requests; a trace repeats (tiles) past its end")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--rate", type=float, help="Poisson arrivals at R requests/s (overrides timestamps)")
    w.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply arrival times (0.1 = 10x the rate)"
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--policy", choices=POLICY_NAMES, default="aligned")
    c.add_argument("--prefetch", choices=("on", "off"), default="on")
    c.add_argument("--prefill-workers", type=int, default=4)
    c.add_argument("--decode-workers", type=int, default=4)
    c.add_argument("--cost-model", choices=cost_model_names(), default="h100-opt-13b")
    c.add_argument("--min-batch", type=int, help="K_min (default: 128 aligned/window, 1 fcfs)")
    c.add_argument("--max-batch", type=int, default=256, help="running requests per decode worker at most")
    c.add_argument(
        "--starvation-s", type=float, help="aging threshold (default: none, as in the paper's runs)"
    )
    c.add_argument("--no-dynamic-prefetch", action="store_true", help="aligned/window: no in-range pulls")
    c.add_argument(
        "--exact-iterations", action="store_true", help="call the scheduler every iteration (slow)"
    )
    o = p.add_argument_group("output")
    o.add_argument("--compare", action="store_true", help="aligned vs fcfs vs prefetch off, with ratios")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    if args.trace is not None or args.workload == "azure":
        specs = read_trace(args.trace or default_trace_path())
        if args.requests is not None:
            specs = take(specs, args.requests)
    else:
        n = args.requests if args.requests is not None else DEFAULT_SYNTHETIC_REQUESTS
        if args.workload == "synthetic":
            specs = synthetic(n, args.short_share, args.seed)
        elif args.workload == "sharegpt":
            specs = sharegpt_like(n, args.seed)
        else:
            specs = longbench_like(n, args.seed)
    if args.rate is not None:
        specs = with_poisson_arrivals(specs, args.rate, args.seed)
    if args.time_scale != 1.0:
        specs = scale_time(specs, args.time_scale)
    return specs


def _quadtree_span(specs: list[RequestSpec], leaf_width: int) -> int:
    """The smallest quad-tree range (leaf_width · 4^d) above every prefix that enters the pool."""
    longest = max((s.input_len for s in specs), default=1) + 1
    span = leaf_width
    while span < longest:
        span *= 4
    return span


def simulate(specs: list[RequestSpec], cost: CostModel, run: RunSpec) -> dict[str, float | int | str]:
    """One run of the real policy and scheduler over `specs`; the JSON summary."""
    policy = make_policy(
        run.policy,
        max_len=_quadtree_span(specs, cost.block_size),
        leaf_width=cost.block_size,
        starvation_s=run.starvation_s,
    )
    metrics = Cluster(specs, cost, policy, plan_iteration, run.config).run()
    return {
        "policy": run.policy,
        "prefetch": "on" if run.prefetch else "off",
        "cost_model": cost.name,
        **metrics.summary,
    }


def _run_spec(args: argparse.Namespace, policy: str, prefetch: bool) -> RunSpec:
    config = ClusterConfig(
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        prefetch=prefetch,
        dynamic_prefetch=policy != "fcfs" and not args.no_dynamic_prefetch,
        min_batch=args.min_batch if args.min_batch is not None else DEFAULT_MIN_BATCH[policy],
        max_batch=args.max_batch,
        exact_iterations=args.exact_iterations,
        # aging makes the policy's answer change with time alone: re-ask a few times per threshold
        batcher_retry_s=args.starvation_s / 4 if args.starvation_s else None,
    )
    return RunSpec(policy, prefetch, config, args.starvation_s)


def compare(specs: list[RequestSpec], cost: CostModel, args: argparse.Namespace) -> dict[str, object]:
    """The paper's comparisons side by side, and their ratios."""
    runs = {
        "aligned": simulate(specs, cost, _run_spec(args, "aligned", True)),
        "fcfs": simulate(specs, cost, _run_spec(args, "fcfs", True)),
        "aligned_prefetch_off": simulate(specs, cost, _run_spec(args, "aligned", False)),
        "fcfs_prefetch_off": simulate(specs, cost, _run_spec(args, "fcfs", False)),
    }
    a, f, off, both = (runs[k] for k in ("aligned", "fcfs", "aligned_prefetch_off", "fcfs_prefetch_off"))

    def ratio(x: object, y: object) -> float:
        return float(x) / float(y) if float(y) else float("nan")  # type: ignore[arg-type]

    ratios = {
        "throughput_aligned_over_fcfs": ratio(a["decode_throughput_tok_s"], f["decode_throughput_tok_s"]),
        "steady_throughput_aligned_over_fcfs": ratio(
            a["steady_throughput_tok_s"], f["steady_throughput_tok_s"]
        ),
        "steady_throughput_loss_prefetch_off": 1.0
        - ratio(off["steady_throughput_tok_s"], a["steady_throughput_tok_s"]),
        "p99_tpot_fcfs_over_aligned": ratio(f["p99_tpot_ms"], a["p99_tpot_ms"]),
        "mean_tpot_fcfs_over_aligned": ratio(f["mean_tpot_ms"], a["mean_tpot_ms"]),
        "throughput_loss_prefetch_off": 1.0
        - ratio(off["decode_throughput_tok_s"], a["decode_throughput_tok_s"]),
        "throughput_loss_prefetch_and_alignment_off": 1.0
        - ratio(both["decode_throughput_tok_s"], a["decode_throughput_tok_s"]),
        "ttft_cost_mean_ms": float(a["mean_ttft_ms"]) - float(f["mean_ttft_ms"]),
        "first_decode_cost_mean_ms": float(a["mean_first_decode_ms"]) - float(f["mean_first_decode_ms"]),
        "mixed_iteration_fraction_aligned": float(a["mixed_iteration_fraction"]),
    }
    return {"requests": len(specs), "runs": runs, "ratios": ratios}


def _print(result: dict[str, object], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=False))
        return
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {json.dumps(v) if isinstance(v, dict) else _fmt(v)}")
        else:
            print(f"{key}: {_fmt(value)}")


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str]) -> int:
    if argv[:1] == ["calibrate"]:
        from alignedserve.sim.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.prefill_workers < 1 or args.decode_workers < 1:
        parser.error("--prefill-workers and --decode-workers must be >= 1")
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be >= 1")
    try:
        specs = build_workload(args)
        cost = make_cost_model(args.cost_model)
        if args.compare:
            result: dict[str, object] = compare(specs, cost, args)
        else:
            result = dict(simulate(specs, cost, _run_spec(args, args.policy, args.prefetch == "on")))
    except (TraceFormatError, FileNotFoundError, ValueError, SimulationError) as e:
        print(f"alignedserve sim: error: {e}", file=sys.stderr)
        return 2
    _print(result, args.json)
    return 0


__all__ = ["RunSpec", "build_workload", "compare", "main", "simulate"]
