"""Request workloads shared by the simulator and the load generator.

A workload is a list of `RequestSpec` (arrival time, prompt tokens, output tokens), sorted by arrival.
Sources: a trace file (the Azure CSV format, or JSONL), synthetic short/long mixes, and ShareGPT-like /
LongBench-like length distributions. Transforms (Poisson arrivals, time and length scaling, `take` with
tiling) return new lists; nothing here mutates its input. Pure: stdlib only, deterministic by seed.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload."""

    arrival_s: float  # seconds after the workload's first arrival
    input_len: int  # prompt tokens (>= 1)
    output_len: int  # tokens to generate (>= 1), the first one included


class TraceFormatError(ValueError):
    """A trace file that is not in a format `read_trace` understands."""


# --- trace files ---------------------------------------------------------------------------------------

_CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_JSONL_KEYS = ("timestamp", "input_length", "output_length")


def default_trace_path() -> Path:
    """The packaged Azure LLM inference trace 2023, conversation service (19,366 requests)."""
    return Path(__file__).resolve().parent / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def read_trace(path: str | Path) -> list[RequestSpec]:
    """Read an Azure-format CSV or a JSONL trace; arrivals become seconds after the first request.

    CSV: header `TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP an ISO date-time.
    JSONL: one object a line with `timestamp` (milliseconds), `input_length`, `output_length`.
    Raises TraceFormatError (naming file and line) on anything else, FileNotFoundError if missing.
    """
    trace = Path(path)
    with trace.open(encoding="utf-8", newline="") as f:
        first = f.readline()
        f.seek(0)
        if first.lstrip().startswith("{"):
            rows = list(_read_jsonl(f, trace))
        elif first.strip():
            rows = list(_read_csv(f, trace))
        else:
            raise TraceFormatError(f"{trace}: empty file")
    if not rows:
        raise TraceFormatError(f"{trace}: no requests")
    return _relative_sorted(rows)


def _read_csv(lines: Iterable[str], trace: Path) -> Iterable[tuple[float, int, int]]:
    reader = csv.reader(lines)
    header = tuple(cell.strip() for cell in next(reader))
    if header[:3] != _CSV_COLUMNS:
        raise TraceFormatError(f"{trace}: CSV header must start with {','.join(_CSV_COLUMNS)}, got {header}")
    for line_no, row in enumerate(reader, start=2):
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) < 3:
            raise TraceFormatError(f"{trace}:{line_no}: expected 3 columns, got {len(row)}")
        try:
            moment = datetime.fromisoformat(row[0].strip())
            # a naive time is read as UTC, so local daylight-saving jumps never bend the trace
            stamp = (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
        except ValueError as e:
            raise TraceFormatError(f"{trace}:{line_no}: bad TIMESTAMP {row[0]!r}") from e
        yield (
            stamp,
            _count(row[1], trace, line_no, "ContextTokens"),
            _count(row[2], trace, line_no, "GeneratedTokens"),
        )


def _read_jsonl(lines: Iterable[str], trace: Path) -> Iterable[tuple[float, int, int]]:
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{trace}:{line_no}: not JSON ({e.msg})") from e
        if not isinstance(obj, dict) or any(k not in obj for k in _JSONL_KEYS):
            raise TraceFormatError(f"{trace}:{line_no}: need keys {', '.join(_JSONL_KEYS)}")
        stamp = obj["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp):
            raise TraceFormatError(f"{trace}:{line_no}: timestamp must be a number of milliseconds")
        yield (
            float(stamp) / 1000.0,
            _count(obj["input_length"], trace, line_no, "input_length"),
            _count(obj["output_length"], trace, line_no, "output_length"),
        )


def _count(value: object, trace: Path, line_no: int, name: str) -> int:
    """A token count: a positive integer (an int, or a string of digits)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceFormatError(f"{trace}:{line_no}: {name} must be a positive integer, got {value!r}")
    return value


def _relative_sorted(rows: list[tuple[float, int, int]]) -> list[RequestSpec]:
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [RequestSpec(stamp - t0, inp, out) for stamp, inp, out in rows]


# --- generated workloads ---------------------------------------------------------------------------------


def synthetic(
    n: int,
    short_share: float,
    seed: int,
    short: tuple[int, int] = (16, 999),
    long: tuple[int, int] = (1000, 8000),
    output: tuple[int, int] = (16, 512),
) -> list[RequestSpec]:
    """The paper's synthetic mix: `short_share` of prompts uniform in `short`, the rest uniform in `long`.

    Outputs are uniform in `output` (default 16–512: mean 264, close to the Azure conversation trace's
    mean of 211). All arrive at t=0 (an offline batch); give arrivals with `with_poisson_arrivals`.
    """
    _check_count(n)
    if not 0.0 <= short_share <= 1.0:
        raise ValueError(f"short_share must be in [0, 1], got {short_share}")
    for name, (lo, hi) in (("short", short), ("long", long), ("output", output)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= lo <= hi, got {(lo, hi)}")
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        lo, hi = short if rng.random() < short_share else long
        specs.append(RequestSpec(0.0, rng.randint(lo, hi), rng.randint(*output)))
    return specs


def sharegpt_like(n: int, seed: int) -> list[RequestSpec]:
    """ShareGPT-like chat lengths: log-normal prompts (mean 161 tokens) and outputs (mean 338 tokens).

    The means are the ShareGPT figures published with vLLM (Kwon et al., SOSP 2023: 8.4x Alpaca's 19.31
    input and 5.8x its 58.45 output tokens); the log-normal shape (sigma 1.0 prompts, 0.9 outputs) is our
    approximation of that paper's histograms. Clipped to [4, 2048] prompt and [1, 2048] output tokens.
    """
    return _lognormal_workload(
        n,
        seed,
        input_mean=161.0,
        input_sigma=1.0,
        input_clip=(4, 2048),
        output_mean=338.0,
        output_sigma=0.9,
        output_clip=(1, 2048),
    )


def longbench_like(n: int, seed: int) -> list[RequestSpec]:
    """LongBench-like long-context lengths: log-normal prompts (mean ~8,700 tokens), short outputs.

    LongBench (Bai et al., ACL 2024) English tasks average 6,711 words, ~8,700 tokens at 1.3 tokens a
    word; its task configs generate 32–512 tokens (QA short, summaries long). We draw prompts log-normal
    (mean 8,700, sigma 0.6) clipped to [1,000, 16,000] — models truncate longer contexts — and outputs
    log-normal (mean 128, sigma 0.8) clipped to [8, 512].
    """
    return _lognormal_workload(
        n,
        seed,
        input_mean=8700.0,
        input_sigma=0.6,
        input_clip=(1000, 16000),
        output_mean=128.0,
        output_sigma=0.8,
        output_clip=(8, 512),
    )


def _lognormal_workload(
    n: int,
    seed: int,
    *,
    input_mean: float,
    input_sigma: float,
    input_clip: tuple[int, int],
    output_mean: float,
    output_sigma: float,
    output_clip: tuple[int, int],
) -> list[RequestSpec]:
    _check_count(n)
    rng = random.Random(seed)
    # log-normal with mean m: mu = ln(m) - sigma^2 / 2
    mu_in = math.log(input_mean) - input_sigma**2 / 2
    mu_out = math.log(output_mean) - output_sigma**2 / 2
    return [
        RequestSpec(
            0.0,
            _clip(round(rng.lognormvariate(mu_in, input_sigma)), input_clip),
            _clip(round(rng.lognormvariate(mu_out, output_sigma)), output_clip),
        )
        for _ in range(n)
    ]


def _clip(value: int, bounds: tuple[int, int]) -> int:
    return min(max(value, bounds[0]), bounds[1])


def _check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"request count must be >= 0, got {n}")


# --- transforms ------------------------------------------------------------------------------------------


def with_poisson_arrivals(specs: Sequence[RequestSpec], rate: float, seed: int) -> list[RequestSpec]:
    """Replace arrival times by a Poisson process of `rate` requests/s (first arrival at t=0)."""
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for spec in specs:
        out.append(replace(spec, arrival_s=t))
        t += rng.expovariate(rate)
    return out


def scale_time(specs: Sequence[RequestSpec], factor: float) -> list[RequestSpec]:
    """Multiply arrival times by `factor` (0.5 = twice the request rate)."""
    if not factor >= 0 or not math.isfinite(factor):
        raise ValueError(f"time scale must be a finite number >= 0, got {factor}")
    return [replace(s, arrival_s=s.arrival_s * factor) for s in specs]


def scale_lengths(specs: Sequence[RequestSpec], factor: float) -> list[RequestSpec]:
    """Multiply prompt and output lengths by `factor` (rounded, at least 1 token each)."""
    if not factor > 0 or not math.isfinite(factor):
        raise ValueError(f"length scale must be a positive number, got {factor}")
    return [
        replace(
            s, input_len=max(1, round(s.input_len * factor)), output_len=max(1, round(s.output_len * factor))
        )
        for s in specs
    ]


def take(specs: Sequence[RequestSpec], n: int) -> list[RequestSpec]:
    """The first `n` requests; past the end, the workload repeats (tiles) with its arrivals shifted.

    Each repetition starts one mean inter-arrival gap after the previous one's last arrival, so a tiled
    trace keeps the original's request rate (e.g. 100,000 requests of the 19,366-request Azure trace
    is the trace 5.16 times over, about 5.2 hours).
    """
    _check_count(n)
    if n <= len(specs):
        return list(specs[:n])
    if not specs:
        raise ValueError("cannot take requests from an empty workload")
    first = min(s.arrival_s for s in specs)
    span = max(s.arrival_s for s in specs) - first
    gap = span / (len(specs) - 1) if len(specs) > 1 else 0.0
    period = span + gap
    out: list[RequestSpec] = []
    rep = 0
    while len(out) < n:
        shift = rep * period
        out.extend(replace(s, arrival_s=s.arrival_s + shift) for s in specs[: n - len(out)])
        rep += 1
    return out
