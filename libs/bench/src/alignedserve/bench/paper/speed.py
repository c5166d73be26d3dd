"""`alignedserve bench sim-speed`: how long the simulator takes for 100,000 requests of the Azure trace's
distribution (the 19,366-request conversation trace tiled, `workloads.take`, at its own rate), per policy.

    alignedserve bench sim-speed --json                      # every policy, 100,000 requests each
    alignedserve bench sim-speed --requests 2000 --policies aligned,vllm --json

Prints one JSON object: per policy the wall and CPU seconds of the run (workload building excluded), the
simulated decode iterations and scheduler calls, and whether every request completed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from alignedserve.sim.baselines.systems import BASELINES
from alignedserve.sim.cli import build_workload, parse_args, run_spec, simulate
from alignedserve.sim.cost_registry import make_cost_model

POLICIES = ("aligned", "fcfs", *BASELINES)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignedserve bench sim-speed", description=__doc__)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    p.add_argument("--cost-model", default="h100-opt-13b")
    p.add_argument("--json", action="store_true", help="JSON only (the default prints it too)")
    return p


def measure(policy: str, requests: int, cost_model: str) -> dict[str, object]:
    args = parse_args(["--workload", "azure", "--requests", str(requests), "--cost-model", cost_model])
    specs = build_workload(args)
    cost = make_cost_model(cost_model)
    wall, cpu = time.perf_counter(), time.process_time()
    summary = simulate(specs, cost, run_spec(args, policy, True))
    return {
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
        "completed": summary["completed"] == requests,
        "iterations": summary["iterations"],
        "sched_calls": summary["sched_calls"],
        "decode_throughput_tok_s": round(float(summary["decode_throughput_tok_s"]), 1),
    }


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        print(f"alignedserve bench sim-speed: unknown policies {unknown}", file=sys.stderr)
        return 2
    result = {
        "requests": args.requests,
        "cost_model": args.cost_model,
        "workload": "azure trace tiled (workloads.take), its own arrival rate",
        "policies": {p: measure(p, args.requests, args.cost_model) for p in policies},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
