"""Time the serving engine (`LLMEngine`) on this CPU: the samples `alignedserve sim calibrate` fits.

What is timed is what the workers run:
- prefill: `engine.prefill(prompts)` wall time for one pass of the prefill worker's shape — one prompt,
  or several prompts in one call (`take_batch` packs queued prompts up to `max_prefill_tokens`; the
  engine splits a longer prompt into chunks of that many tokens, one forward each);
- decode: `engine.step()` wall time of one decode iteration of a running batch (forward, sampling, stop
  checks), as the decode worker steps it. A batch is built cheaply: each distinct prefix is prefilled
  once (its timed prefill pass doubles as the source), its KV exported and imported into every row's
  own blocks (the engine's real import path). One warm-up step per batch (the first iteration of a new
  batch gathers its KV into the staged decode buffers), then one timed step.

The grid is measured `repeats` times over, round-robin, and each shape keeps the median (or the
minimum) of its rounds: on a shared machine other jobs come and go in bursts, and spreading a shape's
samples over the run keeps one burst from owning all of them.

Imports torch: the simulator imports this module only when it measures.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from alignedserve.core.blocks import blocks_for
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_export import KvExport
from alignedserve.engine.loader import LoadedModel, load
from alignedserve.sim.cpu_model import DecodeSample, PrefillSample, describe_lens

BLOCK_SIZE = 16  # the workers' default KV block size
PREFILL_MAX_TOKENS = 2048  # the prefill worker's default `max_prefill_tokens` (services/common)
PREFILL_MAX_SEQS = 64  # ... and `max_num_seqs`


@dataclass(frozen=True, slots=True)
class CalibrationGrid:
    """Shapes to time. Every decode batch is a tuple of prefixes; every prefill pass of prompt lengths."""

    decode: tuple[tuple[int, ...], ...]
    prefill: tuple[tuple[int, ...], ...]
    repeats: int = 3  # rounds over the grid: timed samples per shape
    statistic: str = "min"  # what a shape keeps of its rounds: "min" or "median"
    model: str = "smollm2"
    threads: int | None = None  # torch intra-op threads (None: torch's default, as the workers run)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {sorted(STATISTICS)}, got {self.statistic!r}")
        for shape in (*self.decode, *self.prefill):
            if not shape or min(shape) < 1:
                raise ValueError(f"every shape needs at least one length >= 1, got {shape}")


@dataclass(frozen=True, slots=True)
class EngineMeasurement:
    decode: list[DecodeSample]
    prefill: list[PrefillSample]
    kv_bytes_per_token: int
    block_size: int
    capacity_blocks: int  # blocks a decode worker's default KV budget holds (the engine's default)
    threads: int


Progress = Callable[[str], None]
STATISTICS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


def measure_engine(grid: CalibrationGrid, progress: Progress | None = None) -> EngineMeasurement:
    say = progress or (lambda _: None)
    if grid.threads is not None:
        torch.set_num_threads(grid.threads)
    started = time.perf_counter()
    loaded = load(grid.model, torch.float32, "cpu")
    vocab = int(loaded.config.vocab_size)
    prompts = _Prompts(vocab)
    prefill_engine = _prefill_engine(loaded, grid)
    prefill, sources = _measure_prefill(prefill_engine, grid, prompts, say)
    decode = _measure_decode(loaded, grid, prompts, sources, prefill_engine, say)
    layout = prefill_engine.layout
    say(f"measured in {time.perf_counter() - started:.1f} s")
    return EngineMeasurement(
        decode=decode,
        prefill=prefill,
        kv_bytes_per_token=layout.bytes_per_token,
        block_size=layout.block_size,
        capacity_blocks=DEFAULT_KV_CACHE_BYTES // layout.bytes_per_block,
        threads=torch.get_num_threads(),
    )


class _Prompts:
    """Deterministic random prompts, one per length (ids past the special tokens)."""

    def __init__(self, vocab: int) -> None:
        self._vocab = vocab
        self._made: dict[int, list[int]] = {}

    def get(self, length: int) -> list[int]:
        if length not in self._made:
            rng = random.Random(length)
            self._made[length] = [rng.randrange(100, self._vocab) for _ in range(length)]
        return self._made[length]


# --- prefill -----------------------------------------------------------------------------------------


def _prefill_engine(loaded: LoadedModel, grid: CalibrationGrid) -> LLMEngine:
    needed = max(sum(blocks_for(n + 1, BLOCK_SIZE) for n in s) for s in (*grid.prefill, *grid.decode))
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=needed + 16,
        max_num_seqs=PREFILL_MAX_SEQS,
        max_prefill_tokens=PREFILL_MAX_TOKENS,
    )
    return LLMEngine(config, loaded=loaded)


Source = tuple[KvExport, list[int]]  # a prefix's exported KV and the prompt's first sampled token


def _measure_prefill(
    engine: LLMEngine, grid: CalibrationGrid, prompts: _Prompts, say: Progress
) -> tuple[list[PrefillSample], dict[int, Source]]:
    """One pass per shape and round; single-prompt passes at a decode prefix keep their KV (last round)
    as a decode source."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    _prefill_pass(engine, [prompts.get(16)], params, "warmup", keep=False)  # first forward
    wanted = {n for shape in grid.decode for n in shape}
    times: list[list[float]] = [[] for _ in grid.prefill]
    sources: dict[int, Source] = {}
    for r in range(grid.repeats):
        last = r == grid.repeats - 1
        for shape, shape_times in zip(grid.prefill, times, strict=True):
            keep = last and len(shape) == 1 and shape[0] in wanted
            batch = [prompts.get(n) for n in shape]
            seconds, kept = _prefill_pass(engine, batch, params, f"p{describe_lens(shape)}-{r}", keep)
            shape_times.append(seconds)
            if kept is not None:
                sources[shape[0]] = kept
        say(f"prefill round {r + 1}/{grid.repeats}: " + _line(grid.prefill, [t[-1] for t in times]))
    keep_stat = STATISTICS[grid.statistic]
    samples = [PrefillSample(tuple(s), keep_stat(t)) for s, t in zip(grid.prefill, times, strict=True)]
    return samples, sources


def _line(shapes: Sequence[Sequence[int]], seconds: Sequence[float]) -> str:
    return ", ".join(f"{describe_lens(s)} {t * 1e3:.0f} ms" for s, t in zip(shapes, seconds, strict=True))


def _prefill_pass(
    engine: LLMEngine, batch: Sequence[list[int]], params: SamplingParams, tag: str, keep: bool
) -> tuple[float, Source | None]:
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    start = time.perf_counter()
    outputs = engine.prefill([(i, list(p), params) for i, p in zip(ids, batch, strict=True)])
    seconds = time.perf_counter() - start
    kept = (engine.export_kv(ids[0]), list(outputs[0].output_token_ids)) if keep else None
    for request_id in ids:
        engine.free(request_id)
    return seconds, kept


# --- decode ------------------------------------------------------------------------------------------


def _measure_decode(
    loaded: LoadedModel,
    grid: CalibrationGrid,
    prompts: _Prompts,
    sources: dict[int, Source],
    prefill_engine: LLMEngine,
    say: Progress,
) -> list[DecodeSample]:
    extra = 4  # tokens each row grows by: the warm-up step, the timed one, margin
    params = SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True)
    for n in sorted({n for shape in grid.decode for n in shape} - sources.keys()):
        _, kept = _prefill_pass(prefill_engine, [prompts.get(n)], params, f"src{n}", keep=True)
        assert kept is not None
        sources[n] = kept
    blocks = max(sum(blocks_for(n + extra, BLOCK_SIZE) for n in shape) for shape in grid.decode)
    config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=blocks, max_num_seqs=max(map(len, grid.decode)))
    engine = LLMEngine(config, loaded=loaded)
    steps: list[list[tuple[float, tuple[int, ...]]]] = [[] for _ in grid.decode]
    for r in range(grid.repeats):
        for index, (shape, shape_steps) in enumerate(zip(grid.decode, steps, strict=True)):
            shape_steps.append(_decode_step(engine, shape, prompts, sources, params, f"d{index}-{r}"))
        say(f"decode round {r + 1}/{grid.repeats}: " + _line(grid.decode, [s[-1][0] for s in steps]))
    keep_stat = STATISTICS[grid.statistic]
    # every round builds the batch afresh, so its attended lengths are the same each round
    return [DecodeSample(s[0][1], keep_stat([t for t, _ in s])) for s in steps]


def _decode_step(
    engine: LLMEngine,
    shape: Sequence[int],
    prompts: _Prompts,
    sources: dict[int, Source],
    params: SamplingParams,
    tag: str,
) -> tuple[float, tuple[int, ...]]:
    """One timed decode iteration of a fresh batch of this shape; (seconds, attended tokens a row)."""
    ids = []
    for row, n in enumerate(shape):
        kv, first = sources[n]
        request_id = f"{tag}-{row}"
        engine.import_request(request_id, kv, prompts.get(n), first, params)
        ids.append(request_id)
    _timed_step(engine, len(shape))  # warm-up: the new batch's KV goes into the staged buffers
    # attended tokens this iteration: the cached prefix plus the token being decoded
    kv_lens = tuple(r.num_computed + 1 for r in engine.running_requests())
    seconds = _timed_step(engine, len(shape))
    for request_id in ids:
        engine.free(request_id)
    return seconds, kv_lens


def _timed_step(engine: LLMEngine, rows: int) -> float:
    start = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - start
    if engine.last_step != "decode" or len(outputs) != rows or any(o.finished for o in outputs):
        raise RuntimeError(f"expected one decode iteration over {rows} rows, got {len(outputs)} outputs")
    return seconds
