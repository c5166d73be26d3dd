"""Trace files: the Azure LLM inference trace CSV format, or JSONL; arrivals become seconds after the
first request."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from alignedserve.core.workloads.spec import RequestSpec


class TraceFormatError(ValueError):
    """A trace file that is not in a format `read_trace` understands."""


_CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_JSONL_KEYS = ("timestamp", "input_length", "output_length")


def default_trace_path() -> Path:
    """The packaged Azure LLM inference trace 2023, conversation service (19,366 requests)."""
    core = Path(__file__).resolve().parent.parent
    return core / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


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
