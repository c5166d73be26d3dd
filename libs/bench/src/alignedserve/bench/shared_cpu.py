"""`alignedserve bench shared-cpu`: two engines on one machine's cores, by CPU layout and wait policy.

What `alignedserve up --device cpu` does: a prefill and a decode engine, each its own process, share the
cores. This times a decode step of a batch alone on the whole machine, then beside a second process
that prefills prompts in a loop (that process's pass likewise alone, then beside the decode steps).
Beside each other both engines run as the layout places them (alignedserve.core.cpu_layout: threads,
CPU set, niceness); each (layout, wait policy) runs in fresh processes, since libgomp reads its wait
policy at start. `machine_used` adds the two engines' speeds beside each other as shares of their
speeds alone on the whole machine: 1.0 is a perfect split of the cores, less means the engines burn
what the other one needed (spinning threads, oversubscribed cores).

    alignedserve bench shared-cpu --json [--layouts shared,prefill-yields,split] [--policies passive]
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
from dataclasses import asdict
from itertools import product
from multiprocessing.synchronize import Event
from typing import Any

from alignedserve.core.cpu_layout import LAYOUTS, Placement, Role

# one prefill and one decode engine: the layouts that place only those (a spill engine is the stack's)
PAIR_LAYOUTS = {name: layout for name, layout in LAYOUTS.items() if layout.spill_workers == 0}

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
    p.add_argument("--dtype", default="float32", help="engine dtype (auto: what the services pick)")
    p.add_argument("--batch", type=int, default=8, help="decode rows")
    p.add_argument("--prefix", type=int, default=256, help="tokens in each decode row's KV")
    p.add_argument("--prompt", type=int, default=512, help="tokens per prefill pass of the other engine")
    p.add_argument("--steps", type=int, default=25, help="timed decode steps per phase")
    p.add_argument("--layouts", default="shared", help=f"from {','.join(PAIR_LAYOUTS)}")
    p.add_argument("--policies", default="passive", help=f"from {','.join(POLICIES)}")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child run: "layout/policy"
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args, args.one.split("/")[0])))
        return 0
    layouts, policies = _names(args.layouts, PAIR_LAYOUTS), _names(args.policies, POLICIES)
    if layouts is None or policies is None:
        print(f"bench shared-cpu: error: --layouts takes {','.join(PAIR_LAYOUTS)}; "
              f"--policies takes {','.join(POLICIES)}", file=sys.stderr)  # fmt: skip
        return 2
    runs = [
        {"layout": layout, "policy": policy, **_run_child(layout, policy, argv)}
        for layout, policy in product(layouts, policies)
    ]
    report = {"batch": args.batch, "prefix": args.prefix, "prompt": args.prompt, "dtype": args.dtype,
              "cpus": len(os.sched_getaffinity(0)), "runs": runs}  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _names(text: str, known: dict[str, Any]) -> list[str] | None:
    names = [n for n in text.split(",") if n]
    return names if names and all(n in known for n in names) else None


def _run_child(layout: str, policy: str, argv: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    env.update(POLICIES[policy], HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "alignedserve.bench.shared_cpu", *argv, "--one", f"{layout}/{policy}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {layout}/{policy} run failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def place(placement: Placement) -> None:
    from alignedserve.engine.placement import place_process

    place_process(placement.threads, placement.cpus, placement.nice)


def _placement(layout: str, role: Role, cpus: tuple[int, ...]) -> Placement:
    return PAIR_LAYOUTS[layout].place(role, cpus)


def _whole_machine(cpus: tuple[int, ...]) -> Placement:
    return Placement(len(cpus), cpus)


def measure(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    import torch

    from alignedserve.bench.engine.steps import decode_engine, fill_batch, timed_step
    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig
    from alignedserve.engine.loader import load

    cpus = tuple(sorted(os.sched_getaffinity(0)))  # the machine, before any placement narrows it
    place(_whole_machine(cpus))
    config = EngineConfig(model=args.model, dtype=args.dtype)
    loaded = load(args.model, getattr(torch, config.dtype), "cpu")
    engine = decode_engine(loaded, config, [args.prefix] * args.batch, 3 * args.steps + 8)
    params = SamplingParams(max_tokens=3 * args.steps + 6, temperature=0.0, ignore_eos=True)
    fill_batch(engine, [list(range(300, 300 + args.prefix))] * args.batch, params, "row")
    for _ in range(3):
        timed_step(engine, args.batch)  # warm-up
    decode_alone = statistics.median(timed_step(engine, args.batch) for _ in range(args.steps))

    ctx = mp.get_context("spawn")
    ready, beside, stop = ctx.Event(), ctx.Event(), ctx.Event()
    passes = ctx.Queue()
    other = ctx.Process(target=_prefill_loop, args=(args, layout, cpus, ready, beside, stop, passes))
    other.start()
    ready.wait()
    time.sleep(ALONE_WINDOW_S)
    place(_placement(layout, "decode", cpus))
    beside.set()
    beside_from = time.perf_counter()
    for _ in range(2):
        timed_step(engine, args.batch)  # the new thread count's first parallel regions
    decode_beside = statistics.median(timed_step(engine, args.batch) for _ in range(args.steps))
    stop.set()
    times: list[tuple[float, float]] = passes.get()
    other.join()
    alone = [s for t, s in times if beside_from - ALONE_WINDOW_S < t + s < beside_from]
    beside_passes = [s for t, s in times if t >= beside_from]
    if not alone or not beside_passes:
        raise RuntimeError("the prefill loop ran no pass in one of the windows: raise --steps")
    prefill_alone, prefill_beside = statistics.median(alone), statistics.median(beside_passes)
    return {
        "decode_placement": asdict(_placement(layout, "decode", cpus)),
        "prefill_placement": asdict(_placement(layout, "prefill", cpus)),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(libgomp default)"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "(libgomp default)"),
        "decode_step_alone_ms": round(decode_alone * 1e3, 1),
        "decode_step_beside_prefill_ms": round(decode_beside * 1e3, 1),
        "decode_tokens_per_s_beside": round(args.batch / decode_beside, 1),
        "decode_slowdown": round(decode_beside / decode_alone, 2),
        "prefill_pass_alone_ms": round(prefill_alone * 1e3, 1),
        "prefill_pass_beside_decode_ms": round(prefill_beside * 1e3, 1),
        "prefill_tokens_per_s_beside": round(args.prompt / prefill_beside, 1),
        "prefill_slowdown": round(prefill_beside / prefill_alone, 2),
        "machine_used": round(decode_alone / decode_beside + prefill_alone / prefill_beside, 2),
    }


def _prefill_loop(args: argparse.Namespace, layout: str, cpus: tuple[int, ...], ready: Event,
                  beside: Event, stop: Event, out: Any) -> None:  # fmt: skip
    """The other engine: prefill one prompt after another, alone on the whole machine until `beside`,
    then as the layout places prefill, until told to stop; report (start, seconds) of every pass."""
    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig
    from alignedserve.engine.engine import LLMEngine

    place(_whole_machine(cpus))
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_bytes=2**28)
    engine = LLMEngine(config)
    prompt = list(range(1000, 1000 + args.prompt))
    times: list[tuple[float, float]] = []
    placed = False
    ready.set()
    while not stop.is_set():
        if beside.is_set() and not placed:
            place(_placement(layout, "prefill", cpus))
            placed = True
        request_id = f"p{len(times)}"
        start = time.perf_counter()
        engine.prefill([(request_id, prompt, SamplingParams(max_tokens=2))])
        times.append((start, time.perf_counter() - start))
        engine.free(request_id)
    out.put(times)


def _table(report: dict[str, Any]) -> str:
    lines = ["layout          policy      decode alone/beside ms  prefill alone/beside ms  machine used"]
    for r in report["runs"]:
        lines.append(
            f"{r['layout']:15} {r['policy']:11} {r['decode_step_alone_ms']:8.1f} / "
            f"{r['decode_step_beside_prefill_ms']:<8.1f}    {r['prefill_pass_alone_ms']:8.1f} / "
            f"{r['prefill_pass_beside_decode_ms']:<8.1f}   {r['machine_used']:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
