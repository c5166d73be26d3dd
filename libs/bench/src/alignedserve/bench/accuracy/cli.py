"""`alignedserve bench accuracy`: the reduced-precision accuracy contract (contract.py), as JSON on stdout.

Greedy agreement of the engine with transformers in `--dtype` over the shipped held-out prompts, and the
engine's perplexity in `--dtype` against float32 on the shipped text. Exit status 0 when the contract
holds, 1 when it does not. The defaults take about 70 s on 2 cores without native bfloat16."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignedserve.bench.accuracy import contract, runs


@dataclass(frozen=True)
class Options:
    model: str = "smollm2"
    dtype: str = "bfloat16"
    device: str = "cpu"
    prompts: int = 32  # the first N of the prompt file
    max_tokens: int = 16  # greedy tokens per prompt
    # prompts per engine run and per transformers `generate` call. 1: both sides compute the same shapes.
    # More: bfloat16 rounding then also depends on the batch (GEMM blocking, padding), which flips near
    # ties in either implementation (docs/benchmarks.md), so the figure mixes in batch-shape sensitivity.
    batch: int = 1
    text_tokens: int = 1024  # perplexity: the text's first N tokens
    window: int = 512  # perplexity: tokens per scored window
    threads: int | None = None
    prompts_file: Path = runs.PROMPTS_FILE
    text_file: Path = runs.TEXT_FILE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignedserve bench accuracy", description=__doc__)
    defaults = Options()
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--dtype", default=defaults.dtype, help="the dtype held to the contract")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="first N prompts of the file")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="greedy tokens/prompt")
    parser.add_argument(
        "--batch", type=int, default=defaults.batch, help="prompts per run, on both sides (1: same shapes)"
    )
    parser.add_argument("--text-tokens", type=int, default=defaults.text_tokens, help="perplexity tokens")
    parser.add_argument("--window", type=int, default=defaults.window, help="perplexity window (tokens)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--prompts-file", type=Path, default=defaults.prompts_file, help="JSON lines")
    parser.add_argument("--text-file", type=Path, default=defaults.text_file)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    options = Options(**{k: v for k, v in vars(args).items()})
    for name in ("prompts", "max_tokens", "batch", "window"):
        if getattr(options, name) < 1:
            print(f"alignedserve bench accuracy: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if options.text_tokens < 2:
        print("alignedserve bench accuracy: --text-tokens must be >= 2", file=sys.stderr)
        return 2
    report = measure(options)
    report["command"] = " ".join(["alignedserve", "bench", "accuracy", *argv])
    print(json.dumps(report, indent=2))
    return 0 if report["contract"]["passed"] else 1


def measure(options: Options) -> dict[str, Any]:
    import torch

    from alignedserve.engine.loader import load

    if options.threads is not None:
        torch.set_num_threads(options.threads)
    loaded = load(options.model, getattr(torch, options.dtype), options.device)
    start = time.perf_counter()
    greedy = _greedy(loaded, options)
    greedy["seconds"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    ppl = _perplexity(loaded, options.dtype, options)
    if options.dtype == "float32":
        baseline = ppl
    else:
        del loaded  # one model in memory at a time
        baseline = _perplexity(load(options.model, torch.float32, options.device), "float32", options)
    difference = contract.relative_difference(ppl, baseline)
    perplexity = {
        "text": options.text_file.name,
        "tokens": options.text_tokens,
        "window": options.window,
        options.dtype: ppl,
        "float32": baseline,
        "relative_difference": difference,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return {
        "model": options.model,
        "dtype": options.dtype,
        "device": options.device,
        "threads": torch.get_num_threads(),
        "greedy": greedy,
        "perplexity": perplexity,
        "contract": contract.verdict(greedy["agreement"], difference),
    }


def _greedy(loaded: Any, options: Options) -> dict[str, Any]:
    prompts = runs.encode(loaded, runs.read_prompts(options.prompts_file)[: options.prompts])
    longest = max(len(p) for p in prompts) + options.max_tokens
    batch = min(options.batch, len(prompts))
    engine = runs.engine_for(loaded, options.dtype, options.device, batch, longest)
    ours = runs.engine_greedy(engine, prompts, options.max_tokens, batch)
    theirs = runs.transformers_greedy(loaded, prompts, options.max_tokens, engine.eos_token_ids, batch)
    compared = [contract.compare(i, o, t) for i, (o, t) in enumerate(zip(ours, theirs, strict=True))]
    return {
        "max_tokens": options.max_tokens,
        "batch": batch,
        "reference": "transformers generate, greedy, same weights and dtype",
        **contract.agreement_report(compared),
    }


def _perplexity(loaded: Any, dtype: str, options: Options) -> float:
    windows = runs.text_windows(loaded, options.text_tokens, options.window, options.text_file)
    engine = runs.engine_for(loaded, dtype, options.device, len(windows), options.window + 1)
    return contract.perplexity(runs.engine_logprobs(engine, windows))
