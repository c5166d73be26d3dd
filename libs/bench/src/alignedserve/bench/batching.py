"""`alignedserve bench batching`: pool update and batch-formation speed at 10^4..10^6 waiting requests.

Prefix lengths are drawn (seeded) from the Azure 2023 conversation trace shipped in the package
(context tokens, 2..14,050; clipped to --max-prefix). Per pool size N: build the pool, then time
single removes and inserts (the pool stays at N), then time `form_batch` (each batch is re-inserted as
fresh arrivals, so the pool stays at N). Times are wall-clock (perf_counter) and, because the
machine may be shared, also this thread's CPU time. The pool is moved out of the cyclic GC
(`gc.freeze()`) once built, as a long-running batcher would do; `--no-freeze` measures without.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable
from importlib import resources
from itertools import accumulate
from pathlib import Path
from typing import Any

from alignedserve.batching.aligned import AlignedPolicy
from alignedserve.batching.policies import DEFAULT_POLICY, POLICY_NAMES, make_policy
from alignedserve.batching.types import BatchLimits, BatchPolicy, WaitingRequest
from alignedserve.batching.window import narrowest_window
from alignedserve.core.blocks import blocks_for
from alignedserve.core.stats import percentile

TRACE = "AzureLLMInferenceTrace_conv.csv"


def trace_prefixes(max_prefix: int) -> list[int]:
    text = resources.files("alignedserve.core.data").joinpath("traces", TRACE).read_text()
    rows = csv.DictReader(text.splitlines())
    return [min(max(int(row["ContextTokens"]), 1), max_prefix) for row in rows]


def rss_mb() -> float:
    """Resident memory of this process now (Linux /proc; 0 elsewhere)."""
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return 0.0
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Workload:
    """Seeded request factory: prefixes from the trace, arrivals on a steady clock."""

    def __init__(self, prefixes: list[int], block_size: int, seed: int, shuffled: bool = False) -> None:
        self.prefixes, self.block_size = prefixes, block_size
        self.rng = random.Random(seed)
        self.serial = 0
        self.now = 0.0
        self.shuffled = shuffled  # stress: arrival times out of order (as if all moved in late)

    def request(self) -> WaitingRequest:
        self.serial += 1
        self.now += 1e-4
        prefix = self.rng.choice(self.prefixes)
        arrival = self.rng.uniform(0.0, self.now) if self.shuffled else self.now
        return WaitingRequest(f"q{self.serial}", prefix, blocks_for(prefix, self.block_size), arrival)


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, thread CPU seconds, result)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    result = fn()
    return time.perf_counter() - wall, time.thread_time() - cpu, result


def bench_updates(policy: BatchPolicy, work: Workload, live: list[str], ops: int) -> dict[str, float]:
    ins_wall, ins_cpu, rem_wall, rem_cpu = [], [], [], []
    for _ in range(ops):
        slot = work.rng.randrange(len(live))
        wall, cpu, _ = timed(lambda slot=slot: policy.remove(live[slot]))  # type: ignore[misc]
        rem_wall.append(wall)
        rem_cpu.append(cpu)
        request = work.request()
        wall, cpu, _ = timed(lambda request=request: policy.add(request))  # type: ignore[misc]
        ins_wall.append(wall)
        ins_cpu.append(cpu)
        live[slot] = request.request_id
    return {
        "insert_p50_us": percentile(ins_wall, 50) * 1e6,
        "insert_p99_us": percentile(ins_wall, 99) * 1e6,
        "insert_cpu_p99_us": percentile(ins_cpu, 99) * 1e6,
        "remove_p50_us": percentile(rem_wall, 50) * 1e6,
        "remove_p99_us": percentile(rem_wall, 99) * 1e6,
        "remove_cpu_p99_us": percentile(rem_cpu, 99) * 1e6,
    }


def same_size_oracle(pool: list[WaitingRequest], size: int, max_blocks: int) -> int | None:
    """Spread of the narrowest run of `size` requests that fits (exact for blocks growing with prefix)."""
    ordered = sorted(pool, key=lambda r: r.prefix_len)
    prefixes = [r.prefix_len for r in ordered]
    sums = [0, *accumulate(r.blocks for r in ordered)]
    start = narrowest_window(prefixes, sums, size, max_blocks, 0, len(ordered) - size)
    return None if start is None else prefixes[start + size - 1] - prefixes[start]


def bench_forms(
    policy: BatchPolicy, work: Workload, limits: BatchLimits, forms: int, oracle_samples: int
) -> dict[str, float]:
    walls, cpus, sizes, spreads, bubbles, used = [], [], [], [], [], []
    excess: list[int] = []  # batch spread minus the narrowest spread of as many requests that fit
    for form in range(forms):
        now = work.now
        snapshot = list(policy.tree) if form < oracle_samples and isinstance(policy, AlignedPolicy) else None
        wall, cpu, batch = timed(lambda now=now: policy.form_batch(limits, now))  # type: ignore[misc]
        walls.append(wall)
        cpus.append(cpu)
        if batch:
            lengths = [r.prefix_len for r in batch]
            sizes.append(len(batch))
            spreads.append(max(lengths) - min(lengths))
            # share of attention work lost to the bubble if attention time ~ prefix length
            bubbles.append(1 - sum(lengths) / (len(lengths) * max(lengths)))
            used.append(sum(r.blocks for r in batch) / limits.max_blocks)
            if snapshot is not None:
                best = same_size_oracle(snapshot, len(batch), limits.max_blocks)
                excess.append(spreads[-1] - (best if best is not None else 0))
        for _ in batch:  # keep the pool at N
            policy.add(work.request())
    n = max(len(sizes), 1)
    return {
        "form_p50_ms": percentile(walls, 50) * 1e3,
        "form_p99_ms": percentile(walls, 99) * 1e3,
        "form_cpu_p50_ms": percentile(cpus, 50) * 1e3,
        "form_cpu_p99_ms": percentile(cpus, 99) * 1e3,
        "forms": forms,
        "batch_size_mean": sum(sizes) / n,
        "spread_mean": sum(spreads) / n,
        "spread_p50": percentile(spreads, 50) if spreads else 0.0,
        "spread_max": float(max(spreads, default=0)),
        "bubble_share_mean": sum(bubbles) / n,
        "memory_use_mean": sum(used) / n,
        **(
            {
                "oracle_samples": len(excess),
                "spread_excess_mean": sum(excess) / len(excess),
                "spread_excess_max": max(excess),
            }
            if excess
            else {}
        ),
    }


def run_one(name: str, size: int, args: argparse.Namespace, prefixes: list[int]) -> dict[str, Any]:
    gc.collect()
    base_rss = rss_mb()
    work = Workload(prefixes, args.block_size, args.seed, args.shuffle_arrivals)
    policy = make_policy(
        name, max_len=args.max_prefix + 1, leaf_width=args.block_size, starvation_s=args.starvation_s
    )
    live: list[str] = []
    build = time.perf_counter()
    for _ in range(size):
        request = work.request()
        policy.add(request)
        live.append(request.request_id)
    build = time.perf_counter() - build
    if not args.no_freeze:
        gc.collect()
        gc.freeze()
    row: dict[str, Any] = {"waiting": size, "policy": name, "build_s": build}
    row["rss_growth_mb"] = rss_mb() - base_rss  # allocator reuse makes small N read low
    limits = BatchLimits(max_blocks=args.max_blocks, min_requests=args.min_requests)
    forms = args.forms if name != "window" else max(5, min(args.forms, args.forms * 100_000 // size))
    row.update(bench_updates(policy, work, live, args.ops))
    samples = args.oracle_samples if size <= args.oracle_max_size else 0
    row.update(bench_forms(policy, work, limits, forms, samples))
    del policy, live
    gc.unfreeze()
    gc.collect()
    return row


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="alignedserve bench batching", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated pool sizes N")
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICY_NAMES)
    parser.add_argument("--compare", action="store_true", help="also run the other policies (window, fcfs)")
    parser.add_argument("--ops", type=int, default=5000, help="timed inserts and removes per size")
    parser.add_argument("--forms", type=int, default=300, help="timed batch formations per size")
    parser.add_argument("--max-blocks", type=int, default=4096, help="B_max: decode-worker KV blocks")
    parser.add_argument("--min-requests", type=int, default=128, help="K_min: batch size that saturates")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (= leaf width)")
    parser.add_argument("--max-prefix", type=int, default=8191, help="prefix lengths are clipped to this")
    parser.add_argument("--starvation-s", type=float, default=None, help="aging threshold (default: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--oracle-samples", type=int, default=20, help="aligned batches checked against the exact window"
    )
    parser.add_argument("--oracle-max-size", type=int, default=100_000, help="no oracle checks above this N")
    parser.add_argument(
        "--shuffle-arrivals", action="store_true", help="stress: arrival times out of order (uniform so far)"
    )
    parser.add_argument("--no-freeze", action="store_true", help="leave the built pool in the cyclic GC")
    args = parser.parse_args(argv)
    try:
        args.size_list = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not args.size_list or min(args.size_list) < 1 or min(args.ops, args.forms) < 1:
        parser.error("--sizes, --ops and --forms must be positive")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    prefixes = trace_prefixes(args.max_prefix)
    names = [args.policy] + ([n for n in POLICY_NAMES if n != args.policy] if args.compare else [])
    results: list[dict[str, Any]] = []
    compare: list[dict[str, Any]] = []
    for size in args.size_list:
        for name in names:
            row = run_one(name, size, args, prefixes)
            (results if name == args.policy else compare).append(row)
            if not args.json:
                print(
                    f"{name:8s} N={size:>8,d}  insert p99 {row['insert_p99_us']:6.1f} us  "
                    f"remove p99 {row['remove_p99_us']:6.1f} us  form p50/p99 {row['form_p50_ms']:7.3f}/"
                    f"{row['form_p99_ms']:7.3f} ms (cpu p99 {row['form_cpu_p99_ms']:7.3f})  "
                    f"batch {row['batch_size_mean']:5.1f}  spread {row['spread_mean']:7.1f}  "
                    f"bubble {row['bubble_share_mean']:.3f}  memory {row['memory_use_mean']:.2f}"
                    + (
                        f"  excess spread {row['spread_excess_mean']:.1f}"
                        if "spread_excess_mean" in row
                        else ""
                    )
                )
    config = {
        k: getattr(args, k)
        for k in (
            "max_blocks",
            "min_requests",
            "block_size",
            "max_prefix",
            "ops",
            "forms",
            "seed",
            "starvation_s",
        )
    }
    out: dict[str, Any] = {"results": results, "config": config, "gc_frozen": not args.no_freeze}
    if compare:
        out["compare"] = compare
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
