"""`alignedserve bench shared-cpu`: two engines on one machine's cores, by OpenMP wait policy.

What `alignedserve up --device cpu` does: a prefill and a decode engine, each with its own threads,
share the cores. This times a decode step of a batch alone and beside a second process that prefills
prompts in a loop, and that process's prefill pass alone and beside the decode steps — once per wait
policy (each policy in fresh processes: libgomp reads it at start). `machine_used` adds the two
engines' speeds beside each other as shares of their speeds alone: 1.0 is a perfect split of the cores,
less means spinning threads burn what the other engine needed.

    alignedserve bench shared-cpu --json [--batch 8] [--prefix 256] [--prompt 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from multiprocessing.synchronize import Event
from typing import Any

# policy name -> environment it runs under; "spin" is libgomp's default (threads spin before sleeping)
POLICIES: dict[str, dict[str, str]] = {
    "spin": {},
    "short-spin": {"GOMP_SPINCOUNT": "1000"},  # spin briefly, then sleep
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
ALONE_WINDOW_S = 4.0  # the prefill loop runs alone this long before the decode steps start


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignedserve bench shared-cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=8, help="decode rows (the stack runs ~8 at 16 in flight)")
    p.add_argument("--prefix", type=int, default=256, help="tokens in each decode row's KV")
    p.add_argument("--prompt", type=int, default=512, help="tokens per prefill pass of the other engine")
    p.add_argument("--steps", type=int, default=25, help="timed decode steps per phase")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each engine")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"from {','.join(POLICIES)}")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--one", choices=sorted(POLICIES), help=argparse.SUPPRESS)  # a child run
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args)))
        return 0
    names = [n for n in args.policies.split(",") if n]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        print(f"bench shared-cpu: error: --policies takes {','.join(POLICIES)}", file=sys.stderr)
        return 2
    report = {"batch": args.batch, "prefix": args.prefix, "prompt": args.prompt, "threads": args.threads,
              "policies": {name: _run_child(name, argv) for name in names}}  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _run_child(policy: str, argv: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    env.update(POLICIES[policy], HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "alignedserve.bench.shared_cpu", *argv, "--one", policy]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {policy} run failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from alignedserve.bench.engine.steps import decode_engine, fill_batch, timed_step
    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig
    from alignedserve.engine.loader import load

    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, num_threads=args.threads)
    loaded = load(args.model, torch.float32, "cpu")
    engine = decode_engine(loaded, config, [args.prefix] * args.batch, 3 * args.steps + 8)
    params = SamplingParams(max_tokens=3 * args.steps + 6, temperature=0.0, ignore_eos=True)
    fill_batch(engine, [list(range(300, 300 + args.prefix))] * args.batch, params, "row")
    for _ in range(3):
        timed_step(engine, args.batch)  # warm-up
    decode_alone = statistics.median(timed_step(engine, args.batch) for _ in range(args.steps))

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    passes = ctx.Queue()
    other = ctx.Process(target=_prefill_loop, args=(args, ready, stop, passes))
    other.start()
    ready.wait()
    time.sleep(ALONE_WINDOW_S)
    beside_from = time.perf_counter()
    decode_beside = statistics.median(timed_step(engine, args.batch) for _ in range(args.steps))
    stop.set()
    times: list[tuple[float, float]] = passes.get()
    other.join()
    alone = [s for t, s in times if beside_from - ALONE_WINDOW_S < t < beside_from]
    beside = [s for t, s in times if t >= beside_from]
    if not alone or not beside:
        raise RuntimeError("the prefill loop ran no pass in one of the windows: raise --steps")
    prefill_alone, prefill_beside = statistics.median(alone), statistics.median(beside)
    return {
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(libgomp default)"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "(libgomp default)"),
        "decode_step_alone_ms": round(decode_alone * 1e3, 1),
        "decode_step_beside_prefill_ms": round(decode_beside * 1e3, 1),
        "decode_slowdown": round(decode_beside / decode_alone, 2),
        "prefill_pass_alone_ms": round(prefill_alone * 1e3, 1),
        "prefill_pass_beside_decode_ms": round(prefill_beside * 1e3, 1),
        "prefill_slowdown": round(prefill_beside / prefill_alone, 2),
        "machine_used": round(decode_alone / decode_beside + prefill_alone / prefill_beside, 2),
    }


def _prefill_loop(args: argparse.Namespace, ready: Event, stop: Event, out: Any) -> None:
    """The other engine: prefill one prompt after another until told to stop; report (start, seconds)."""
    import torch

    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig
    from alignedserve.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads, kv_cache_bytes=2**28))
    prompt = list(range(1000, 1000 + args.prompt))
    times: list[tuple[float, float]] = []
    ready.set()
    while not stop.is_set():
        request_id = f"p{len(times)}"
        start = time.perf_counter()
        engine.prefill([(request_id, prompt, SamplingParams(max_tokens=2))])
        times.append((start, time.perf_counter() - start))
        engine.free(request_id)
    out.put(times)


def _table(report: dict[str, Any]) -> str:
    lines = ["policy  decode alone/beside ms  prefill alone/beside ms  machine used"]
    for name, r in report["policies"].items():
        lines.append(
            f"{name:7} {r['decode_step_alone_ms']:8.1f} / {r['decode_step_beside_prefill_ms']:<8.1f}"
            f"    {r['prefill_pass_alone_ms']:8.1f} / {r['prefill_pass_beside_decode_ms']:<8.1f}"
            f"   {r['machine_used']:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
