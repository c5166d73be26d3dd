"""`alignedserve bench paper`: run every experiment of the paper's evaluation in the simulator and write
docs/paper-vs-sim.md (and the raw summaries as JSON).

    alignedserve bench paper --out docs/paper-vs-sim.md --json-out docs/data/paper-vs-sim.json
    alignedserve bench paper --scale tiny --out /tmp/paper.md      # seconds: what the unit test runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from alignedserve.bench.paper.experiments import (
    SCALES,
    Scale,
    app_jobs,
    forward_jobs,
    latency_jobs,
    synthetic_jobs,
)
from alignedserve.bench.paper.jobs import Job, run_jobs
from alignedserve.bench.paper.report import render
from alignedserve.bench.paper.sensitivity import sensitivity_jobs


def all_jobs(scale: Scale) -> list[Job]:
    return [
        *synthetic_jobs(scale),
        *app_jobs(scale),
        *forward_jobs(scale),
        *latency_jobs(scale),
        *sensitivity_jobs(scale),
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alignedserve bench paper",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--out", type=Path, help="markdown report (default: stdout)")
    p.add_argument("--json-out", type=Path, help="every run's JSON summary, by key")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    scale = SCALES[args.scale]
    started = time.perf_counter()
    results = run_jobs(all_jobs(scale), args.jobs, progress=not args.quiet)
    wall = time.perf_counter() - started
    document = render(results, scale, wall, args.jobs)
    if args.out is None:
        print(document)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(document, encoding="utf-8")
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(json.dumps({"runs": len(results), "wall_s": round(wall, 1), "scale": scale.name}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
