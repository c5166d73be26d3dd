"""Device copy bandwidth, decode throughput against it, and the paper's motivating experiment."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from alignedserve.bench.gpu_check.engines import (
    fill_batch,
    load_preset,
    make_engine,
    median_ms,
    ms,
    release,
    sync,
    timed_steps,
    weight_bytes,
)
from alignedserve.bench.gpu_check.profiles import Profile
from alignedserve.engine.loader import LoadedModel


def copy_bandwidth(profile: Profile, repeats: int = 10) -> dict[str, Any]:
    """Device-to-device copy of `copy_bytes` (read + write counted): the HBM ceiling decode is held to."""
    source = torch.empty(profile.copy_bytes, dtype=torch.uint8, device=profile.device)
    target = torch.empty_like(source)
    target.copy_(source)
    sync(profile.device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    sync(profile.device)
    seconds = (time.perf_counter() - start) / repeats
    return {"bytes": profile.copy_bytes, "gbps": round(2 * profile.copy_bytes / seconds / 1e9, 2)}


def decode_throughput(profile: Profile, loaded: LoadedModel, copy_gbps: float) -> dict[str, Any]:
    """tok/s per batch size and backend; achieved bandwidth = (weights + K/V read) bytes / step time."""
    weights = weight_bytes(loaded)
    cases = []
    for backend in profile.backends:
        engine = make_engine(loaded, profile, backend, profile.kv_bytes)
        per_token = engine.layout.bytes_per_token
        for batch in profile.batches:
            ids = fill_batch(engine, [profile.prefix] * batch, profile.steps + 2, seed=batch)
            times = timed_steps(engine, profile.steps, profile.device)
            release(engine, ids)
            step_s = statistics.median(times)
            kv_read = batch * (profile.prefix + 1 + profile.steps // 2) * per_token
            achieved = (weights + kv_read) / step_s / 1e9
            cases.append(
                {
                    "backend": backend,
                    "batch": batch,
                    "step_ms": ms(step_s),
                    "tok_s": round(batch / step_s, 1),
                    "hbm_gbps": round(achieved, 2),
                    "share_of_copy": round(achieved / copy_gbps, 3),
                }
            )
        del engine
        _free(profile)
    return {"model": loaded.model_id, "prefix": profile.prefix, "weight_bytes": weights, "cases": cases}


def motivating(profile: Profile) -> dict[str, Any]:
    """Batch of short rows vs the same batch with `long_rows` of them long: per-iteration latency as
    tokens are generated (the paper: 13.49 vs 21.73 ms, batch 64, 4 x 4,096 tokens, Llama-7B, H100)."""
    loaded = load_preset(profile, profile.paper_model)
    batch, long_rows = profile.motivating_batch, profile.long_rows
    shapes = {
        "all_short": [profile.short] * batch,
        "mixed": [profile.short] * (batch - long_rows) + [profile.long] * long_rows,
    }
    runs = []
    for backend in profile.backends:
        engine = make_engine(loaded, profile, backend, profile.kv_bytes)
        for name, lengths in shapes.items():
            ids = fill_batch(engine, lengths, profile.motivating_steps + 2, seed=7)
            times = timed_steps(engine, profile.motivating_steps, profile.device)
            release(engine, ids)
            runs.append(
                {"backend": backend, "batch": name, "median_ms": median_ms(times),
                 "iteration_ms": [ms(t) for t in times]}
            )  # fmt: skip
        del engine
        _free(profile)
    ratios = {
        backend: round(_median(runs, backend, "mixed") / _median(runs, backend, "all_short"), 3)
        for backend in profile.backends
    }
    return {
        "model": loaded.model_id,
        "batch": batch,
        "short_tokens": profile.short,
        "long_rows": long_rows,
        "long_tokens": profile.long,
        "mixed_over_short": ratios,
        "runs": runs,
        "paper": {"all_short_ms": 13.49, "mixed_ms": 21.73, "setup": "Llama-7B, H100, vLLM"},
    }


def _median(runs: list[dict[str, Any]], backend: str, batch: str) -> float:
    value: float = next(r["median_ms"] for r in runs if r["backend"] == backend and r["batch"] == batch)
    return value


def _free(profile: Profile) -> None:
    if profile.device.startswith("cuda"):
        torch.cuda.empty_cache()
