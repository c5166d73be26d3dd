"""`alignedserve bench compile`: what torch.compile (inductor) would buy the decode step, and cost at start.

The profile (`alignedserve bench profile`) leaves ~15-20 % of a step outside the linears and attention:
the element-wise ops between them. This compiles the engine's own element-wise pieces of a Llama layer
(`rotary` for q and k, the gated SiLU of the MLP) with `torch.compile(dynamic=True)`, in fresh processes
sharing one inductor cache directory: the first process compiles cold, the second finds the cache
(warm). Each reports the first call's seconds (the start-up cost), eager and compiled microseconds per
call at each row count, and whether the compiled output is bit-identical to eager. Whole-model
compilation of `LlamaFamilyModel.hidden` (a tiny random model, the engine's own call) is tried too and
its outcome reported.

    alignedserve bench compile --json [--rows 1,16,64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignedserve bench compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rows", default="1,16,64", help="decode rows (tokens) per call")
    p.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per function and row count")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--one", choices=["cold", "warm"], help=argparse.SUPPRESS)  # a child run
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="alignedserve-inductor-") as cache:
        runs = {start: _child(argv, start, cache) for start in ("cold", "warm")}
    report = {"dtype": args.dtype, "rows": args.rows, **runs}
    print(json.dumps(report, indent=2) if args.json else json.dumps(report))
    return 0


def _child(argv: list[str], start: str, cache: str) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    command = [sys.executable, "-m", "alignedserve.bench.engine.compile_check", *argv, "--one", start]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {start} run failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from alignedserve.engine.model import rotary

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:  # sin: signed
        return rotary(q, cos, sin), rotary(k, cos, sin)

    def gated_silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up  # the Llama MLP's act_fn(gate) * up

    def inputs(name: str, rows: int) -> tuple[torch.Tensor, ...]:
        shapes: dict[str, list[tuple[int, ...]]] = {  # SmolLM2's sizes
            "rope": [(rows, 9, 64), (rows, 3, 64), (rows, 1, 64), (rows, 1, 64)],
            "gated_silu": [(rows, 1536), (rows, 1536)],
        }
        return tuple(torch.randn(shape).to(dtype) for shape in shapes[name])

    functions: dict[str, Callable[..., Any]] = {"rope": rope, "gated_silu": gated_silu}
    rows = [int(r) for r in args.rows.split(",")]
    out: dict[str, Any] = {"functions": {}}
    with torch.inference_mode():  # as the engine runs
        for name, eager in functions.items():
            compiled = torch.compile(eager, dynamic=True)
            started = time.perf_counter()
            compiled(*inputs(name, rows[0]))
            first_call_s = time.perf_counter() - started
            per_rows = {}
            for count in rows:
                x = inputs(name, count)
                same = _same(eager(*x), compiled(*x))
                per_rows[count] = {"eager_us": _per_call_us(eager, x, args.calls),
                                   "compiled_us": _per_call_us(compiled, x, args.calls), "bit_identical": same}  # fmt: skip
            out["functions"][name] = {"first_call_s": round(first_call_s, 2), "rows": per_rows}
    out["whole_model"] = _whole_model(dtype)
    return out


def _per_call_us(fn: Callable[..., Any], x: tuple[Any, ...], calls: int) -> float:
    for _ in range(50):
        fn(*x)
    started = time.perf_counter()
    for _ in range(calls):
        fn(*x)
    return round((time.perf_counter() - started) / calls * 1e6, 1)


def _same(a: Any, b: Any) -> bool:
    import torch

    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return all(torch.equal(x, y) for x, y in pairs)


def _whole_model(dtype: Any) -> str:
    """Compile the engine's model forward (tiny random Llama) and run one prefill: "ok" or the error."""
    import torch

    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig
    from alignedserve.engine.engine import LLMEngine
    from alignedserve.engine.random_model import preset_config, random_model

    loaded = random_model(preset_config("llama-tiny"), dtype, "cpu")
    engine = LLMEngine(EngineConfig(dtype=str(dtype).removeprefix("torch."), num_blocks=16), loaded=loaded)
    model: Any = engine.runner.model
    model.hidden = torch.compile(model.hidden, dynamic=True)
    try:
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0))
    except Exception as exc:  # what dynamo/inductor refuse is the finding
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"  # inductor puts the cause second
    return "ok"


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
