"""The engine's side of the engine bench: decode throughput and the mixed/aligned iteration ratio.

A batch is built without paying B prefills: one prompt is prefilled once, its KV exported, and imported
into every row's own newly allocated blocks (the engine's real import path), so each row holds a full
private copy of the KV. Then `step()` is timed: every timed step is one decode iteration of the whole
batch, sampling and stop checks included.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from alignedserve.bench.stats import DecodeRate, rate_from_gaps
from alignedserve.core.blocks import blocks_for
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_export import KvExport
from alignedserve.engine.loader import LoadedModel
from alignedserve.engine.timing import IterationTiming


def decode_engine(
    loaded: LoadedModel, config: EngineConfig, prefixes: Sequence[int], extra_tokens: int
) -> LLMEngine:
    """An engine with exactly enough KV blocks for rows at these prefixes plus `extra_tokens` each
    (and one prompt being prefilled), sharing the already loaded model."""
    blocks = sum(blocks_for(p + extra_tokens + 1, config.block_size) for p in prefixes)
    blocks += blocks_for(max(prefixes) + 1, config.block_size)  # the source prompt while it is exported
    sized = dataclasses.replace(
        config, kv_cache_bytes=None, num_blocks=blocks, max_num_seqs=max(len(prefixes), 1)
    )
    return LLMEngine(sized, loaded=loaded)


def fill_batch(
    engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams, tag: str
) -> list[str]:
    """Make one running request per prompt; identical prompts share one prefill, then KV import."""
    ids: list[str] = []
    sources: dict[tuple[int, ...], tuple[KvExport, list[int]]] = {}
    for row, prompt in enumerate(prompts):
        key = tuple(prompt)
        if key not in sources:
            source_id = f"{tag}-source-{len(sources)}"
            first = engine.prefill([(source_id, list(prompt), params)])[0]
            sources[key] = (engine.export_kv(source_id), first.output_token_ids)
            engine.free(source_id)
        kv, first_tokens = sources[key]
        request_id = f"{tag}-{row}"
        engine.import_request(request_id, kv, list(prompt), list(first_tokens), params)
        ids.append(request_id)
    return ids


def timed_step(engine: LLMEngine, batch: int) -> float:
    start = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - start
    if len(outputs) != batch or any(o.finished for o in outputs):
        raise RuntimeError(f"expected a decode iteration over {batch} rows, got {len(outputs)} outputs")
    return seconds


def engine_decode(
    loaded: LoadedModel, config: EngineConfig, prompt: list[int], batch: int, steps: int
) -> DecodeRate:
    """Decode rate of the engine with `batch` copies of `prompt`, greedy, EOS ignored."""
    params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
    engine = decode_engine(loaded, config, [len(prompt)] * batch, steps + 3)
    fill_batch(engine, [prompt] * batch, params, "decode")
    timed_step(engine, batch)  # warm-up iteration (first use of these shapes)
    gaps = [timed_step(engine, batch) for _ in range(steps)]
    return rate_from_gaps(batch, gaps)


@dataclass(frozen=True)
class IterationStats:
    """Median decode iteration of one batch composition, split as the engine's timing hooks see it."""

    prefixes: str
    iteration_s: float
    attention_s: float
    linear_s: float
    attention_strategy: str


@dataclass(frozen=True)
class MixedAligned:
    mixed: IterationStats
    aligned: IterationStats
    ratio: float  # median mixed iteration / median aligned iteration
    paired_ratio: float  # median over interleaved pairs of (mixed / aligned): robust to drift


MIXED_SHORT = (60, 32)  # 60 requests at a 32-token prefix ...
MIXED_LONG = (4, 4096)  # ... and 4 at 4096: the paper's motivating batch of 64


def mixed_over_aligned(
    loaded: LoadedModel, config: EngineConfig, prompt_source: Sequence[int], steps: int
) -> MixedAligned:
    """Iteration latency of the mixed batch over an aligned batch of 64 at the same mean prefix (same
    total KV, so the same attention FLOPs). The two batches live in two engines sharing the model and
    step alternately, so machine noise hits both alike."""
    mixed = [MIXED_SHORT[1]] * MIXED_SHORT[0] + [MIXED_LONG[1]] * MIXED_LONG[0]
    mean = round(sum(mixed) / len(mixed))
    aligned = [mean] * len(mixed)
    timed = dataclasses.replace(config, timings=True)
    params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
    engines = []
    for name, prefixes in (("mixed", mixed), ("aligned", aligned)):
        engine = decode_engine(loaded, timed, prefixes, steps + 3)
        fill_batch(engine, [list(prompt_source[:p]) for p in prefixes], params, name)
        timed_step(engine, len(prefixes))  # warm-up
        engine.timings.clear()
        engines.append(engine)
    walls: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for engine, wall in zip(engines, walls, strict=True):
            wall.append(timed_step(engine, len(mixed)))
    stats = [
        _stats(label, wall, list(engine.timings))
        for label, wall, engine in zip(
            (f"{MIXED_SHORT[0]}x{MIXED_SHORT[1]}+{MIXED_LONG[0]}x{MIXED_LONG[1]}", f"64x{mean}"),
            walls,
            engines,
            strict=True,
        )
    ]
    paired = statistics.median(m / a for m, a in zip(*walls, strict=True))
    return MixedAligned(stats[0], stats[1], stats[0].iteration_s / stats[1].iteration_s, paired)


def _stats(label: str, wall: list[float], timings: list[IterationTiming]) -> IterationStats:
    decode = [t for t in timings if t.kind == "decode"]
    strategies = sorted({t.attention_strategy for t in decode})
    return IterationStats(
        prefixes=label,
        iteration_s=statistics.median(wall),
        attention_s=statistics.median(t.attention_s for t in decode),
        linear_s=statistics.median(t.linear_s for t in decode),
        attention_strategy="+".join(strategies),
    )
