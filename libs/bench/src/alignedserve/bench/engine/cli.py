"""`alignedserve bench engine`: decode throughput of the engine next to transformers, in one run.

For every (dtype, prefix, batch) case, three systems decode the same prompt (repeated `batch` times,
greedy, EOS ignored) with the same model: the engine, transformers `generate` on a static batch, and
transformers continuous batching. Only decode is timed (see bench_engine / bench_hf); each system's
figure is batch / median iteration time, and with `--repeats` rounds (systems interleaved per round)
the median over rounds. Also measured: the matmul roofline at the model's linear shapes (weights in
cache; and every layer's own weights streamed from memory, as a step reads them) and the mixed/aligned
iteration ratio of the engine (the effect prefix-aware batching removes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alignedserve.engine.config import EngineConfig


@dataclass(frozen=True)
class Defaults:
    batches: str
    prefixes: str
    dtypes: str
    steps: int
    repeats: int


FULL = Defaults(batches="1,16,64,256", prefixes="128,2048", dtypes="float32,bfloat16", steps=16, repeats=3)
QUICK = Defaults(batches="1,16,64", prefixes="128", dtypes="float32", steps=8, repeats=1)
SYSTEMS = ("engine", "hf_static", "hf_cb")
RATIO_PROMPT_TOKENS = 4096


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alignedserve bench engine",
        description="Engine decode throughput vs transformers (static generate, continuous batching).",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    parser.add_argument("--quick", action="store_true", help=f"small run: {QUICK}")
    parser.add_argument("--batches", help=f"comma list (default {FULL.batches})")
    parser.add_argument("--prefixes", help=f"comma list of prompt lengths (default {FULL.prefixes})")
    parser.add_argument("--dtypes", help=f"comma list (default {FULL.dtypes})")
    parser.add_argument("--steps", type=int, help="decode iterations timed per measurement")
    parser.add_argument("--repeats", type=int, help="rounds per case; figures are medians over rounds")
    parser.add_argument(
        "--cb-repeats", type=int, default=None, help="rounds for continuous batching (its prefill is slow)"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="subset of engine,hf_static,hf_cb")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--attention", default="auto", help="engine decode attention strategy")
    parser.add_argument(
        "--decode-backend", default="auto", help="engine decode attention backend: auto, torch, cpu, ..."
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads for every system")
    parser.add_argument(
        "--max-kv-gib",
        type=float,
        default=None,
        help="skip a system in a case whose KV would exceed this (default: 30%% of available memory)",
    )
    parser.add_argument(
        "--ratio-steps", type=int, default=None, help="iterations for the mixed/aligned ratio"
    )
    parser.add_argument("--no-ratio", action="store_true", help="skip the mixed/aligned experiment")
    parser.add_argument("--no-roofline", action="store_true", help="skip the matmul roofline")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens")
    parser.add_argument("--linear", default="auto", help="engine linear kernel: auto, torch or onednn_packed")
    return parser


@dataclass
class Settings:
    batches: list[int]
    prefixes: list[int]
    dtypes: list[str]
    steps: int
    repeats: int
    cb_repeats: int
    systems: list[str]
    kv_budget_bytes: int
    ratio_steps: int


@dataclass
class Case:
    batch: int
    prefix: int
    dtype: str
    engine_tok_s: float | None = None
    hf_static_tok_s: float | None = None
    hf_cb_tok_s: float | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def ratios(self) -> dict[str, float | None]:
        def over(base: float | None) -> float | None:
            return None if self.engine_tok_s is None or not base else self.engine_tok_s / base

        return {
            "engine_over_hf_static": over(self.hf_static_tok_s),
            "engine_over_hf_cb": over(self.hf_cb_tok_s),
        }


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = _settings(args)
    except ValueError as error:
        print(f"alignedserve bench engine: error: {error}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = run(args, settings)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def run(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    import torch

    from alignedserve.bench.engine.roofline import linear_shapes
    from alignedserve.engine.loader import load

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    longest = max([*settings.prefixes, RATIO_PROMPT_TOKENS])
    report: dict[str, Any] = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "steps": settings.steps,
        "repeats": settings.repeats,
        "cb_repeats": settings.cb_repeats,
        "kv_budget_gib": round(settings.kv_budget_bytes / 2**30, 2),
        "cases": [],
        "roofline": [],
        "roofline_fraction": [],
        "load_s": {},
    }
    if not args.no_roofline:
        from alignedserve.bench.engine.roofline import measure_read_bandwidth

        report["read_gb_s"] = round(measure_read_bandwidth(), 2)
    started = time.perf_counter()
    for dtype in settings.dtypes:
        loaded = load(args.model, getattr(torch, dtype), "cpu")
        report["load_s"][dtype] = round(loaded.load_seconds, 2)
        vocab = int(loaded.config.vocab_size)
        # Ordinary-token ids only (skip the low special-token range), same prompt for every system.
        tokens = torch.randint(256, vocab, (longest,), generator=generator).tolist()
        shapes = linear_shapes(loaded.hf_model)
        if not args.no_roofline:
            report["roofline"] += _rooflines(shapes, settings.batches, dtype)
        for prefix in settings.prefixes:
            for batch in settings.batches:
                case = _run_case(args, settings, loaded, tokens[:prefix], batch, dtype)
                report["cases"].append({**_case_json(case), **case.ratios()})
                _progress(case)
        if not args.no_roofline:
            report["roofline_fraction"] += _fractions(report, shapes, dtype)
        if not args.no_ratio and dtype == settings.dtypes[0]:
            report.update(_ratio(args, settings, loaded, tokens, dtype))
        del loaded
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def _run_case(
    args: argparse.Namespace, settings: Settings, loaded: Any, prompt: list[int], batch: int, dtype: str
) -> Case:
    from alignedserve.bench.engine.hf import hf_continuous_decode, hf_static_decode
    from alignedserve.bench.engine.steps import engine_decode
    from alignedserve.bench.stats import DecodeRate

    config = _engine_config(args, dtype)
    runners: dict[str, Callable[[], DecodeRate]] = {
        "engine": lambda: engine_decode(loaded, config, prompt, batch, settings.steps),
        "hf_static": lambda: hf_static_decode(loaded.hf_model, prompt, batch, settings.steps),
        "hf_cb": lambda: hf_continuous_decode(loaded.hf_model, prompt, batch, settings.steps),
    }
    case = Case(batch=batch, prefix=len(prompt), dtype=dtype)
    need = _kv_needs(loaded, dtype, batch, len(prompt), settings.steps)
    active = []
    for system in settings.systems:
        if need[system] > settings.kv_budget_bytes:
            case.skipped[system] = (
                f"needs {need[system] / 2**30:.1f} GiB of KV, over the {settings.kv_budget_bytes / 2**30:.1f} GiB "
                "budget (--max-kv-gib)"
            )
        else:
            active.append(system)
            case.samples[system] = []
    for round_ in range(settings.repeats):  # rounds: every system once per round
        for system in active:
            if system == "hf_cb" and round_ >= settings.cb_repeats:
                continue
            case.samples[system].append(round(runners[system]().tok_s, 3))
    for system in active:
        setattr(case, f"{system}_tok_s", round(statistics.median(case.samples[system]), 3))
    return case


def _kv_needs(loaded: Any, dtype: str, batch: int, prefix: int, steps: int) -> dict[str, int]:
    import torch

    from alignedserve.bench.engine.hf import CB_MAX_BATCH_TOKENS, CB_PAGE_SIZE

    config = loaded.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * element
    tokens = prefix + steps + 4
    cb_tokens = prefix + steps + -(-batch * prefix // CB_MAX_BATCH_TOKENS) + 4
    return {
        "engine": batch * tokens * per_token,
        "hf_static": 2 * batch * tokens * per_token,  # DynamicCache grows by torch.cat: old + new copy
        "hf_cb": batch * -(-cb_tokens // CB_PAGE_SIZE) * CB_PAGE_SIZE * per_token,
    }


def _rooflines(shapes: Any, batches: list[int], dtype: str) -> list[dict[str, Any]]:
    import torch

    from alignedserve.bench.engine.roofline import measure_roofline, measure_streamed_linears

    streamed = measure_streamed_linears(shapes, batches, getattr(torch, dtype))
    rows = []
    for batch in batches:
        roof = measure_roofline(shapes, batch, getattr(torch, dtype))
        flops = shapes.linear_flops_per_token * batch
        rows.append(
            {
                "dtype": dtype,
                "batch": batch,
                "linear_gflops": round(roof.gflops, 2),
                "peak_gflops": round(roof.peak_gflops, 2),
                "linear_bound_tok_s": round(roof.linear_bound_tok_s, 2),
                # every layer's own weight, read from memory as a step reads it
                "streamed_linear_gflops": round(flops / streamed[batch] / 1e9, 2),
                "streamed_linear_bound_tok_s": round(batch / streamed[batch], 2),
            }
        )
    return rows


def _fractions(report: dict[str, Any], shapes: Any, dtype: str) -> list[dict[str, Any]]:
    """Engine FLOP rate (2 x params + attention per token) against the matmul roofline at the same batch,
    and the bytes its steps read (weights once a step, each row's K/V) against the read bandwidth."""
    import torch

    roofs = {(r["dtype"], r["batch"]): r for r in report["roofline"]}
    rows = []
    for case in report["cases"]:
        roof = roofs.get((case["dtype"], case["batch"]))
        if case["dtype"] != dtype or roof is None or case["engine_tok_s"] is None:
            continue
        flops = shapes.flops_per_token(case["prefix"])
        engine_gflops = case["engine_tok_s"] * flops / 1e9
        step_bytes = shapes.bytes_per_step(case["batch"], case["prefix"], getattr(torch, dtype).itemsize)
        engine_gb_s = case["engine_tok_s"] / case["batch"] * step_bytes / 1e9
        rows.append(
            {
                "dtype": dtype,
                "batch": case["batch"],
                "prefix": case["prefix"],
                "flops_per_token": flops,
                "engine_gflops": round(engine_gflops, 2),
                "fraction_of_linear_roofline": round(engine_gflops / roof["linear_gflops"], 3),
                "fraction_of_peak_shape": round(engine_gflops / roof["peak_gflops"], 3),
                "engine_over_linear_bound_tok_s": round(case["engine_tok_s"] / roof["linear_bound_tok_s"], 3),
                "engine_over_streamed_linear_bound_tok_s": round(
                    case["engine_tok_s"] / roof["streamed_linear_bound_tok_s"], 3
                ),
                "bytes_per_step": step_bytes,
                "engine_gb_s": round(engine_gb_s, 2),
                "fraction_of_read_bandwidth": round(engine_gb_s / report["read_gb_s"], 3),
            }
        )
    return rows


def _engine_config(args: argparse.Namespace, dtype: str) -> EngineConfig:
    from alignedserve.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=dtype,
        attention=args.attention,
        linear_kernel=args.linear,
        decode_backend=args.decode_backend,
    )


def _ratio(
    args: argparse.Namespace, settings: Settings, loaded: Any, tokens: list[int], dtype: str
) -> dict[str, Any]:
    from alignedserve.bench.engine.steps import mixed_over_aligned

    config = _engine_config(args, dtype)
    result = mixed_over_aligned(loaded, config, tokens, settings.ratio_steps)
    return {
        "mixed_over_aligned_iteration": round(result.ratio, 3),
        "mixed_aligned": {
            "dtype": config.dtype,
            "paired_ratio": round(result.paired_ratio, 3),
            "mixed": asdict(result.mixed),
            "aligned": asdict(result.aligned),
        },
    }


def _settings(args: argparse.Namespace) -> Settings:
    defaults = QUICK if args.quick else FULL
    systems = _words(args.systems)
    if unknown := set(systems) - set(SYSTEMS):
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    dtypes = _words(args.dtypes or defaults.dtypes)
    if unknown := set(dtypes) - {"float32", "bfloat16"}:
        raise ValueError(f"dtypes {sorted(unknown)} are not benchmarked on CPU; use float32, bfloat16")
    steps = defaults.steps if args.steps is None else args.steps
    repeats = defaults.repeats if args.repeats is None else args.repeats
    settings = Settings(
        batches=_ints(args.batches or defaults.batches, "batches"),
        prefixes=_ints(args.prefixes or defaults.prefixes, "prefixes"),
        dtypes=dtypes,
        steps=steps,
        repeats=repeats,
        cb_repeats=repeats if args.cb_repeats is None else min(args.cb_repeats, repeats),
        systems=systems,
        kv_budget_bytes=int((args.max_kv_gib or _default_budget_gib()) * 2**30),
        ratio_steps=steps if args.ratio_steps is None else args.ratio_steps,
    )
    if settings.steps < 2 or settings.ratio_steps < 2:
        raise ValueError("--steps and --ratio-steps must be >= 2")
    if settings.repeats < 1 or settings.cb_repeats < 1:
        raise ValueError("--repeats and --cb-repeats must be >= 1")
    return settings


def _words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(w) for w in _words(text)]
    except ValueError:
        raise ValueError(f"--{name} must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name} must list positive integers, got {text!r}")
    return values


def _default_budget_gib() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return 0.3 * int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 4.0


def _case_json(case: Case) -> dict[str, Any]:
    return {
        "batch": case.batch,
        "prefix": case.prefix,
        "dtype": case.dtype,
        "engine_tok_s": case.engine_tok_s,
        "hf_static_tok_s": case.hf_static_tok_s,
        "hf_cb_tok_s": case.hf_cb_tok_s,
        "samples": case.samples,
        "skipped": case.skipped,
    }


def _progress(case: Case) -> None:
    print(
        f"[bench engine] {case.dtype} batch {case.batch} prefix {case.prefix}: engine {case.engine_tok_s} "
        f"hf_static {case.hf_static_tok_s} hf_cb {case.hf_cb_tok_s} tok/s {case.skipped or ''}",
        file=sys.stderr,
        flush=True,
    )


def _print_table(report: dict[str, Any]) -> None:
    print(f"{'dtype':9} {'batch':>5} {'prefix':>6} {'engine':>9} {'hf_static':>9} {'hf_cb':>9}  tok/s")
    for c in report["cases"]:
        cells = [f"{c[k]:9.1f}" if c[k] is not None else f"{'-':>9}" for k in SYSTEMS_KEYS]
        print(f"{c['dtype']:9} {c['batch']:5d} {c['prefix']:6d} {' '.join(cells)}")
    if "mixed_over_aligned_iteration" in report:
        print(f"mixed/aligned iteration: {report['mixed_over_aligned_iteration']}")


SYSTEMS_KEYS = tuple(f"{s}_tok_s" for s in SYSTEMS)
