"""`alignedserve sim calibrate`: fit the CPU cost model from measured iterations and write its JSON.

Two sources of samples, one fit:
- default: time the serving engine (`LLMEngine`, SmolLM2-135M float32) on this CPU, as the workers run
  it: decode iterations at a grid of batch sizes x prefixes plus mixed-length batches (varying the prefix
  at a fixed batch separates the attention term from the linear one), and prefill passes of one or
  several prompts (see `engine_timing`);
- `--samples FILE.jsonl`: timings measured elsewhere, one object a line:
  {"kind": "decode", "kv_lens": [...], "seconds": s} or {"kind": "prefill", "input_lens": [...], "seconds": s}.
`--write-samples FILE.jsonl` saves the samples in that format (to refit later without measuring).

The fit's quality (R², relative residuals per sample) goes into the JSON's `fit` and to stderr.

    alignedserve sim calibrate                      # measure here, write libs/alignedserve/sim/cpu_smollm2.json
    alignedserve sim calibrate --write-samples var/cpu-samples.jsonl
    alignedserve sim calibrate --samples var/cpu-samples.jsonl --kv-bytes-per-token 46080
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from alignedserve.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from alignedserve.sim.cpu_model import (
    CALIBRATION_PATH,
    CpuCalibration,
    CpuCoefficients,
    CpuCostModel,
    DecodeSample,
    FitQuality,
    PrefillSample,
    decode_fit_quality,
    fit_decode,
    fit_prefill,
    prefill_fit_quality,
)

DEFAULT_COMMAND = "alignedserve sim calibrate"
DEFAULT_BATCHES = "1,4,16,48"
DEFAULT_PREFIXES = "64,256,1024"
DEFAULT_MIXED = "12x64+4x1024,14x128+2x2048,8x64+8x512,15x256+1x1024"
# one prompt a pass, and several (the prefill worker packs queued prompts up to 2,048 tokens a pass)
DEFAULT_PROMPTS = "16,256,1024,2048,8x32,16x64,4x512"
# The engine keeps a decode batch's K/V in contiguous staged buffers up to this many bytes (the decode
# worker's default), each row with this many tokens of headroom (StagedKv.HEADROOM_TOKENS; not imported
# here: that module pulls torch). A batch past it is gathered from the paged blocks every iteration.
STAGED_KV_BYTES = EngineConfig().staged_kv_bytes
STAGING_HEADROOM_TOKENS = 32


def gathered_regime(sample: DecodeSample, kv_bytes_per_token: int) -> bool:
    """The batch's K/V does not fit the engine's staged buffers: every iteration gathers it from the
    paged blocks, several times slower — a regime the linear model does not describe (fitted without
    it; reported apart)."""
    tokens = sum(n + STAGING_HEADROOM_TOKENS for n in sample.kv_lens)
    return tokens * kv_bytes_per_token > STAGED_KV_BYTES


def read_samples(path: Path) -> tuple[list[DecodeSample], list[PrefillSample]]:
    decode: list[DecodeSample] = []
    prefill: list[PrefillSample] = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            seconds = float(obj["seconds"])
            if obj["kind"] == "decode":
                decode.append(DecodeSample(tuple(int(n) for n in obj["kv_lens"]), seconds))
            elif obj["kind"] == "prefill":
                prefill.append(PrefillSample(tuple(int(n) for n in obj["input_lens"]), seconds))
            else:
                raise ValueError(f"kind must be decode or prefill, got {obj['kind']!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{line_no}: bad sample ({e})") from e
    return decode, prefill


def samples_jsonl(decode: Sequence[DecodeSample], prefill: Sequence[PrefillSample]) -> str:
    """The samples in the format `read_samples` reads."""
    lines = [{"kind": "decode", "kv_lens": list(s.kv_lens), "seconds": s.seconds} for s in decode]
    lines += [{"kind": "prefill", "input_lens": list(s.input_lens), "seconds": s.seconds} for s in prefill]
    return "".join(json.dumps(line) + "\n" for line in lines)


def measure_copy_bytes_per_s(megabytes: int = 64, repeats: int = 5) -> float:
    """Host memory copy bandwidth (numpy), the 'link' between processes on one machine."""
    src = np.ones(megabytes * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return src.nbytes / best


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'16,8x32,12x64+4x1024' -> [(16,), (32,)*8, (64,)*12 + (1024,)*4]."""
    shapes = []
    for item in text.split(","):
        if not item.strip():
            continue
        shape: list[int] = []
        for part in item.split("+"):
            count, _, length = part.strip().rpartition("x")
            try:
                shape += [int(length)] * (int(count) if count else 1)
            except ValueError:
                raise ValueError(f"bad shape {item!r}: want LEN, NxLEN or NxLEN+MxLEN") from None
        shapes.append(tuple(shape))
    return shapes


def decode_grid(batches: str, prefixes: str, mixed: str) -> list[tuple[int, ...]]:
    grid = [(p,) * b for b in _ints(batches) for p in _ints(prefixes)]
    return grid + parse_shapes(mixed)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alignedserve sim calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--samples", type=Path, help="JSONL of measured iterations instead of measuring here")
    p.add_argument("--write-samples", type=Path, help="also write the samples as JSONL (--samples format)")
    p.add_argument("--source", default="", help="what measured the samples (recorded in the JSON)")
    p.add_argument("--kv-bytes-per-token", type=int, help="with --samples: the engine's KV bytes a token")
    p.add_argument(
        "--kv-budget-gib",
        type=float,
        default=DEFAULT_KV_CACHE_BYTES / 2**30,
        help="KV memory a decode worker holds (default: the engine's, which the decode worker keeps)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", default=DEFAULT_BATCHES, help="decode batch sizes")
    p.add_argument("--prefixes", default=DEFAULT_PREFIXES, help="decode prefixes (tokens in the KV)")
    p.add_argument("--mixed", default=DEFAULT_MIXED, help="mixed decode batches, e.g. 12x64+4x1024")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prefill passes: LEN or NxLEN, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the grid: timed samples per shape")
    p.add_argument(
        "--statistic",
        choices=("median", "min"),
        default="min",
        help="what a shape keeps of its rounds (min: other jobs on a shared machine only ever add time)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, as the workers run)")
    p.add_argument("--out", type=Path, default=CALIBRATION_PATH)
    return p


def _measure(args: argparse.Namespace) -> tuple[list[DecodeSample], list[PrefillSample], int, str]:
    from alignedserve.bench.engine_timing import CalibrationGrid, measure_engine  # imports torch

    grid = CalibrationGrid(
        decode=tuple(decode_grid(args.batches, args.prefixes, args.mixed)),
        prefill=tuple(parse_shapes(args.prompts)),
        repeats=args.repeats,
        statistic=args.statistic,
        threads=args.threads,
    )
    m = measure_engine(grid, progress=lambda line: print(f"[calibrate] {line}", file=sys.stderr, flush=True))
    source = args.source or (
        f"alignedserve LLMEngine, SmolLM2-135M float32, {m.threads} torch threads, on this CPU: "
        f"wall time of engine.step() (decode) and engine.prefill() (prefill passes), {args.statistic} "
        f"of {args.repeats} rounds"
    )
    return m.decode, m.prefill, m.kv_bytes_per_token, source


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.samples is not None:
            if args.kv_bytes_per_token is None:
                raise ValueError("--samples needs --kv-bytes-per-token")
            decode, prefill = read_samples(args.samples)
            kv_bytes = args.kv_bytes_per_token
            source = args.source or f"samples from {args.samples.name}"
        else:
            decode, prefill, kv_bytes, source = _measure(args)
        if args.write_samples is not None:
            args.write_samples.write_text(samples_jsonl(decode, prefill), encoding="utf-8")
        gathered = [s for s in decode if gathered_regime(s, kv_bytes)]
        staged = [s for s in decode if not gathered_regime(s, kv_bytes)]
        d_base, d_seq, d_tok, d_multi = fit_decode(staged)
        p_base, p_tok, p_sq = fit_prefill(prefill)
    except ValueError as e:
        print(f"alignedserve sim calibrate: error: {e}", file=sys.stderr)
        return 2
    calibration = CpuCalibration(
        name="cpu-smollm2",
        model="SmolLM2-135M-Instruct",
        block_size=args.block_size,
        kv_bytes_per_token=kv_bytes,
        capacity_blocks=int(args.kv_budget_gib * 2**30) // (args.block_size * kv_bytes),
        coefficients=CpuCoefficients(
            d_base, d_seq, d_tok, p_base, p_tok, p_sq, measure_copy_bytes_per_s(), d_multi
        ),
        source=source,
        command=" ".join([DEFAULT_COMMAND, *argv]),
        decode_samples=len(staged),
        prefill_samples=len(prefill),
    )
    model = CpuCostModel(calibration)
    quality = {"decode": decode_fit_quality(model, staged), "prefill": prefill_fit_quality(model, prefill)}
    if gathered:
        quality["decode_gathered_not_fitted"] = decode_fit_quality(model, gathered)
    calibration = _with_fit(calibration, quality)
    _report(quality)
    args.out.write_text(calibration.to_json(), encoding="utf-8")
    print(calibration.to_json(), end="")
    return 0


def _with_fit(calibration: CpuCalibration, quality: dict[str, FitQuality]) -> CpuCalibration:
    fit: dict[str, Any] = {kind: q.to_json() for kind, q in quality.items()}
    return replace(calibration, fit=fit)


def _report(quality: dict[str, FitQuality]) -> None:
    for kind, q in quality.items():
        print(
            f"[calibrate] {kind} fit: R² {q.r2:.4f}, relative residual rms {q.rms_relative:.1%}, "
            f"max {q.max_relative:.1%}",
            file=sys.stderr,
        )
        for r in q.residuals:
            print(
                f"[calibrate]   {r.shape:>18}  measured {r.measured_s * 1e3:9.2f} ms  "
                f"model {r.predicted_s * 1e3:9.2f} ms  {r.relative:+.1%}",
                file=sys.stderr,
            )
