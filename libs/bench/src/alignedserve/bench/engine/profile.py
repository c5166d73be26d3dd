"""`alignedserve bench profile`: where one decode iteration of the engine spends its time, per op.

Builds a batch of `--batch` rows at a `--prefix`-token KV (bench.engine.steps: one prefill, KV imported
into every row), runs warm-up iterations, then records `--steps` iterations with torch.profiler and
prints the ops by self CPU time per iteration, as JSON. The split the issue of a fast decode step needs:
matmuls (aten::addmm / mm / linear / onednn), attention, and everything else (per-op overhead).

    alignedserve bench profile --batch 16 --prefix 256 --dtype float32 --steps 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "onednn")
ATTENTION_OPS = ("attention", "aten::_scaled_dot_product", "aten::softmax", "aten::_softmax")


@dataclass(frozen=True)
class OpRow:
    name: str
    calls_per_step: float
    self_ms_per_step: float
    share: float  # of the profiled self CPU time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignedserve bench profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--batch", type=int, default=16, help="rows in the decode batch")
    p.add_argument("--prefix", type=int, default=256, help="KV tokens per row")
    p.add_argument("--steps", type=int, default=8, help="profiled decode iterations")
    p.add_argument("--warmup", type=int, default=3, help="iterations before profiling")
    p.add_argument("--top", type=int, default=25, help="ops listed")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--linear", default="auto", help="engine linear kernel: auto, torch or onednn_packed")
    p.add_argument(
        "--decode-backend", default="auto", help="engine decode attention backend: auto, torch, cpu, ..."
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def category(name: str) -> str:
    lowered = name.lower()
    if any(op in lowered for op in ATTENTION_OPS):
        return "attention"
    if any(op in lowered for op in MATMUL_OPS):
        return "matmul"
    return "other"


def op_rows(events: list[tuple[str, int, float]], steps: int, top: int) -> list[OpRow]:
    """events: (op name, calls, self CPU µs) over all profiled steps -> the top ops per step."""
    total_us = sum(us for _, _, us in events) or 1.0
    ranked = sorted(events, key=lambda e: e[2], reverse=True)[:top]
    return [
        OpRow(name, round(calls / steps, 1), round(us / steps / 1000, 3), round(us / total_us, 4))
        for name, calls, us in ranked
    ]


def split(events: list[tuple[str, int, float]], steps: int) -> dict[str, float]:
    """Self CPU ms per step by category, and the op calls per step (the per-op overhead's count)."""
    per: dict[str, float] = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, _, us in events:
        per[category(name)] += us / steps / 1000
    out = {f"{k}_ms_per_step": round(v, 3) for k, v in per.items()}
    out["op_calls_per_step"] = round(sum(calls for _, calls, _ in events) / steps, 1)
    return out


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    print(json.dumps(run(args), indent=2))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from alignedserve.bench.engine.steps import decode_engine, fill_batch, timed_step
    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig
    from alignedserve.engine.loader import load

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load(args.model, getattr(torch, args.dtype), "cpu")
    config = EngineConfig(
        model=args.model, dtype=args.dtype, linear_kernel=args.linear, decode_backend=args.decode_backend
    )
    vocab = int(loaded.config.vocab_size)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(256, vocab, (args.prefix,), generator=generator).tolist()
    extra = args.warmup + 2 * args.steps + 3  # unprofiled and profiled steps, then room to spare
    engine = decode_engine(loaded, config, [args.prefix] * args.batch, extra)
    params = SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True)
    fill_batch(engine, [prompt] * args.batch, params, "profile")
    for _ in range(args.warmup):
        timed_step(engine, args.batch)
    started = time.perf_counter()
    unprofiled = [timed_step(engine, args.batch) for _ in range(args.steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            timed_step(engine, args.batch)
    events = [(e.key, int(e.count), float(e.self_cpu_time_total)) for e in prof.key_averages()]
    unprofiled.sort()
    return {
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "prefix": args.prefix,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "step_ms_median_unprofiled": round(unprofiled[len(unprofiled) // 2] * 1000, 2),
        "wall_s": round(time.perf_counter() - started, 1),
        **split(events, args.steps),
        "ops": [asdict(r) for r in op_rows(events, args.steps, args.top)],
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
