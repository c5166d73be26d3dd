"""`alignedserve sim`: replay a workload through a simulated cluster driven by the real batching code.

alignedserve sim --workload synthetic --short-share 0.95 --requests 4000 --json
alignedserve sim --trace libs/core/src/alignedserve/core/data/traces/AzureLLMInferenceTrace_conv.csv --time-scale 0.1
alignedserve sim --workload azure --requests 100000 --json      # the trace tiled (workloads.take)
alignedserve sim --compare --workload synthetic --short-share 0.95   # aligned vs fcfs vs prefetch off
alignedserve sim --deployment stack --concurrency 16 --requests 64 --length-scale 0.25 \
    --max-input-len 4096 --max-output-len 256                     # what `make bench-e2e` sends the stack
alignedserve sim calibrate --help     # refit the CPU cost model (from alignedserve-bench)
alignedserve sim vs-stack --help      # predicted vs measured bench-e2e rows (from alignedserve-bench)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from alignedserve.batching.policies import POLICY_NAMES, make_policy
from alignedserve.batching.scheduler import plan_iteration
from alignedserve.core.workloads.arrivals import OPEN_LOOP, ArrivalProcess, ClosedLoop
from alignedserve.core.workloads.build import WorkloadConfig, WorkloadSource, build_specs
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.traces import TraceFormatError, default_trace_path, read_trace
from alignedserve.core.workloads.transforms import scale_time, with_poisson_arrivals
from alignedserve.sim.baselines.engine import BaselineCluster
from alignedserve.sim.baselines.systems import BASELINES, baseline_config
from alignedserve.sim.cluster import Cluster, ClusterConfig
from alignedserve.sim.compute import COMPUTE
from alignedserve.sim.cost import CostModel
from alignedserve.sim.cost_registry import cost_model_names, make_cost_model
from alignedserve.sim.deployments import DEPLOYMENTS, Deployment
from alignedserve.sim.records import SimulationError

WORKLOADS = ("synthetic", "azure", "sharegpt", "longbench")
DEFAULT_SYNTHETIC_REQUESTS = 2000


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One simulated configuration."""

    policy: str
    prefetch: bool
    config: ClusterConfig
    starvation_s: float | None
    max_len: int | None = None  # quad-tree range; None: just above the workload's longest prompt


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
    w.add_argument(
        "--long-range", type=int, nargs=2, metavar=("LO", "HI"), help="synthetic: long prompts (1000 8000)"
    )
    w.add_argument("--requests", type=int, help="first N requests; a trace repeats (tiles) past its end")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--rate", type=float, help="Poisson arrivals at R requests/s (overrides timestamps)")
    w.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply arrival times (0.1 = 10x the rate)"
    )
    w.add_argument(
        "--concurrency", type=int, help="closed loop: C requests in flight, the next one on each completion"
    )
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply every prompt and output length")
    w.add_argument("--max-input-len", type=int, help="cap prompts (after --length-scale), as the loadgen")
    w.add_argument("--max-output-len", type=int, help="cap outputs (after --length-scale)")
    c = p.add_argument_group("cluster (defaults from --deployment)")
    c.add_argument(
        "--deployment",
        choices=sorted(DEPLOYMENTS),
        default="paper",
        help="paper: 4+4 H100s, OPT-13B, K_min 128; stack: the services' defaults on cpu-smollm2",
    )
    c.add_argument(
        "--policy",
        choices=(*POLICY_NAMES, *BASELINES),
        default="aligned",
        help="aligned|fcfs|window: this system's batcher; vllm|vllm-nochunk|fastgen|distserve: the paper's "
        "baselines on the same instances (baselines/systems.py)",
    )
    c.add_argument("--prefetch", choices=("on", "off"), default="on")
    c.add_argument("--prefill-workers", type=int)
    c.add_argument("--decode-workers", type=int)
    c.add_argument("--cost-model", choices=cost_model_names())
    c.add_argument("--min-batch", type=int, help="K_min (paper: 128 aligned/window, 1 fcfs; stack: 16)")
    c.add_argument("--max-batch", type=int, help="running requests per decode worker at most")
    c.add_argument("--fill", type=float, help="share of a decode worker's blocks a new batch may take")
    c.add_argument("--range-slack", type=int, help="dynamic prefetch: tokens above the running range")
    c.add_argument("--max-prefill-tokens", type=int, help="prompt tokens per prefill pass")
    c.add_argument(
        "--starvation-s",
        type=float,
        help="aging threshold, 0: off (paper: off, as in its runs; stack: the batcher's 10 s)",
    )
    c.add_argument("--no-dynamic-prefetch", action="store_true", help="aligned/window: no in-range pulls")
    c.add_argument(
        "--growth-reserve",
        type=int,
        help="blocks per running request an admission leaves free (paper deployment: 1; 0: the paper's rule)",
    )
    c.add_argument(
        "--compute",
        choices=sorted(COMPUTE),
        help="dedicated: a device per worker (paper); shared: all engines on one machine's cores (stack)",
    )
    c.add_argument(
        "--exact-iterations", action="store_true", help="call the scheduler every iteration (slow)"
    )
    o = p.add_argument_group("output")
    o.add_argument("--compare", action="store_true", help="aligned vs fcfs vs prefetch off, with ratios")
    o.add_argument("--with-baselines", action="store_true", help="--compare: add vllm, fastgen, distserve")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    """The load generator's description of the same workload: the same `build_specs` builds the lengths,
    so a simulated run replays exactly what `alignedserve-loadgen` sends for the same flags and seed."""
    source: WorkloadSource
    if args.trace is not None or args.workload == "azure":
        source = "trace"
        n = (
            args.requests
            if args.requests is not None
            else len(read_trace(args.trace or default_trace_path()))
        )
    else:
        source = args.workload
        n = args.requests if args.requests is not None else DEFAULT_SYNTHETIC_REQUESTS
    lengths = {"long_range": (args.long_range[0], args.long_range[1])} if args.long_range else {}
    return WorkloadConfig(
        **lengths,
        source=source,
        num_requests=n,
        seed=args.seed,
        short_share=args.short_share,
        trace_path=args.trace,
        length_scale=args.length_scale,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
    )


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    """Lengths from `build_specs`, as the load generator builds them; then arrival times (ignored by a
    closed loop)."""
    specs: list[RequestSpec] = build_specs(workload_config(args))
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
    """One run of the real policy and scheduler (or of a baseline system) over `specs`; the JSON summary."""
    if run.policy in BASELINES:
        c = run.config
        config = baseline_config(
            run.policy, specs, c.prefill_workers, c.decode_workers, c.arrivals, c.exact_iterations
        )
        summary = BaselineCluster(specs, cost, config).run().summary
        return {"policy": run.policy, "prefetch": "n/a", "cost_model": cost.name, **summary}
    span = _quadtree_span(specs, cost.block_size)
    policy = make_policy(
        run.policy,
        max_len=max(run.max_len, span) if run.max_len is not None else span,
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


def choose_arrivals(args: argparse.Namespace) -> ArrivalProcess:
    return ClosedLoop(args.concurrency) if args.concurrency is not None else OPEN_LOOP


def _deployment(args: argparse.Namespace) -> Deployment:
    """--deployment's defaults with every cluster flag given on the command line applied."""
    d = DEPLOYMENTS[args.deployment]
    overrides = {
        "prefill_workers": args.prefill_workers,
        "decode_workers": args.decode_workers,
        "cost_model": args.cost_model,
        "max_batch": args.max_batch,
        "fill": args.fill,
        "range_slack": args.range_slack,
        "max_prefill_tokens": args.max_prefill_tokens,
        "compute": args.compute,
        "growth_reserve": args.growth_reserve,
    }
    d = replace(d, **{k: v for k, v in overrides.items() if v is not None})
    if args.min_batch is not None:
        d = replace(d, min_batch=args.min_batch, fcfs_min_batch=args.min_batch)
    if args.starvation_s is not None:
        d = replace(d, starvation_s=args.starvation_s or None)  # 0: aging off
    if args.no_dynamic_prefetch:
        d = replace(d, dynamic_prefetch_policies=frozenset())
    return d


def run_spec(args: argparse.Namespace, policy: str, prefetch: bool) -> RunSpec:
    d = _deployment(args)
    config = d.cluster_config(policy, prefetch, choose_arrivals(args))
    config = replace(config, exact_iterations=args.exact_iterations)
    return RunSpec(policy, prefetch, config, d.starvation_s, d.max_len)


def compare(specs: list[RequestSpec], cost: CostModel, args: argparse.Namespace) -> dict[str, object]:
    """The paper's comparisons side by side, and their ratios."""
    runs = {
        "aligned": simulate(specs, cost, run_spec(args, "aligned", True)),
        "fcfs": simulate(specs, cost, run_spec(args, "fcfs", True)),
        "aligned_prefetch_off": simulate(specs, cost, run_spec(args, "aligned", False)),
        "fcfs_prefetch_off": simulate(specs, cost, run_spec(args, "fcfs", False)),
    }
    a, f, off, both = (runs[k] for k in ("aligned", "fcfs", "aligned_prefetch_off", "fcfs_prefetch_off"))
    baselines = (
        {name: simulate(specs, cost, run_spec(args, name, True)) for name in BASELINES}
        if args.with_baselines
        else {}
    )

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
        "misaligned_iteration_fraction_aligned": float(a["misaligned_iteration_fraction"]),
    }
    for name, run in baselines.items():
        ratios[f"throughput_aligned_over_{name}"] = ratio(
            a["decode_throughput_tok_s"], run["decode_throughput_tok_s"]
        )
        ratios[f"p99_tpot_{name}_over_aligned"] = ratio(run["p99_tpot_ms"], a["p99_tpot_ms"])
    return {"requests": len(specs), "runs": {**runs, **baselines}, "ratios": ratios}


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


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag, value in (
        ("--prefill-workers", args.prefill_workers),
        ("--decode-workers", args.decode_workers),
        ("--requests", args.requests),
        ("--concurrency", args.concurrency),
    ):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1")
    if args.concurrency is not None and args.rate is not None:
        parser.error("--concurrency (closed loop) and --rate (Poisson) exclude each other")
    if not args.length_scale > 0:
        parser.error("--length-scale must be > 0")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The simulation flags, checked (exits with a usage error like any argparse parser)."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        specs = build_workload(args)
        cost = make_cost_model(_deployment(args).cost_model)
        if args.compare:
            result: dict[str, object] = compare(specs, cost, args)
        else:
            result = dict(simulate(specs, cost, run_spec(args, args.policy, args.prefetch == "on")))
    except (TraceFormatError, FileNotFoundError, ValueError, SimulationError) as e:
        print(f"alignedserve sim: error: {e}", file=sys.stderr)
        return 2
    _print(result, args.json)
    return 0


__all__ = [
    "RunSpec",
    "build_workload",
    "choose_arrivals",
    "compare",
    "main",
    "parse_args",
    "run_spec",
    "simulate",
    "workload_config",
]
