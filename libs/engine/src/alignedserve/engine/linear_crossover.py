"""From how many rows the packed weights beat `F.linear` on this host: measured once, kept on disk.

Which kernel is faster at few rows depends on the CPU: on one development host the packed weights were
1.49x faster at one row, on another 0.74x (docs/benchmarks.md, Engine). The crossover is measured on
the model's own projections the first time a model of those shapes is loaded with that many threads,
and written to `$ALIGNEDSERVE_CACHE_DIR/linear-crossover.json` (default `~/.cache/alignedserve`). The first
process to write an answer wins and every later one reads it, so all engines of a host (prefill and
decode workers, `alignedserve generate`) multiply alike and give the same greedy tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from alignedserve.core.models import cache_root

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # decode's batch sizes where the answer can change
# Timed calls per kernel, shape and row count, the two kernels alternating call by call; the minimum is
# kept (noise only adds time). With 3 calls, not alternated, a busy host once stored "packed never
# wins" where packed was 1.6-2.5x faster at 16 rows, and every later engine of that host kept it.
REPEATS = 9
KEY_VERSION = "v2"  # answers measured by an earlier rule are measured again


def cache_path() -> Path:
    return cache_root() / "linear-crossover.json"


def host_key(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.float32) -> str:
    """What the answer depends on: the CPU (model name and instruction sets), torch, its thread count,
    the weights' dtype and the projections' shapes."""
    digest = hashlib.sha256(repr((_cpu_identity(), str(dtype), sorted(shapes))).encode()).hexdigest()[:16]
    return f"{KEY_VERSION}|torch {torch.__version__}|threads {torch.get_num_threads()}|{digest}"


Call = Callable[[torch.Tensor], object]
# (torch kernel, packed kernel, in_features, weight) for one projection (group) shape; weight: how many
# projections of the model have that shape (a decode step runs each of them)
Probe = tuple[Call, Call, int, int]


_KNOWN: dict[str, int] = {}  # this process's answers: later engines of the same model skip the file


def min_packed_rows(key: str, probes: list[Probe], dtype: torch.dtype = torch.float32) -> int:
    """Fewest rows from which the packed kernel is used: known for `key` (in this process or on disk),
    else measured (inputs in `dtype`, the weights') and stored."""
    if key not in _KNOWN:
        path = cache_path()
        stored = _read(path).get(key)
        _KNOWN[key] = stored if isinstance(stored, int) else _store(path, key, measure(probes, dtype))
    return _KNOWN[key]


def measure(probes: list[Probe], dtype: torch.dtype = torch.float32) -> int:
    """Smallest row count from which packed is at least as fast, summed over every probe, at each
    larger count measured. Above the largest count (prefill chunks) packed is used."""
    packed_wins: list[bool] = []
    with torch.inference_mode():
        for rows in ROW_COUNTS:
            inputs = {n: torch.randn(rows, n, dtype=dtype) for n in {p[2] for p in probes}}
            t_torch = t_packed = 0.0
            for torch_call, packed_call, n, weight in probes:
                best_torch, best_packed = _best_pair(torch_call, packed_call, inputs[n])
                t_torch += weight * best_torch
                t_packed += weight * best_packed
            packed_wins.append(t_packed <= t_torch)
    return crossover(ROW_COUNTS, packed_wins)


def crossover(row_counts: tuple[int, ...], packed_wins: list[bool]) -> int:
    """The smallest measured count from which packed wins at it and every larger one; past the
    largest count when packed loses there (it is still used beyond: prefill chunks)."""
    answer = row_counts[-1] + 1
    for rows, wins in reversed(list(zip(row_counts, packed_wins, strict=True))):
        if not wins:
            break
        answer = rows
    return answer


def _best_pair(first: Call, second: Call, x: torch.Tensor) -> tuple[float, float]:
    """Fastest of REPEATS calls of each, alternating, so a burst of load hits both alike."""
    first(x), second(x)  # warm-up: first-call allocations
    best = [float("inf"), float("inf")]
    for _ in range(REPEATS):
        for index, call in enumerate((first, second)):
            start = time.perf_counter()
            call(x)
            best[index] = min(best[index], time.perf_counter() - start)
    return best[0], best[1]


def _read(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(path: Path, key: str, measured: int) -> int:
    """Add `key` unless another process did first; returns the answer on disk (theirs if they won)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_suffix(".lock")
        fd = _lock(lock)
        try:
            data = _read(path)
            if not isinstance(data.get(key), int):
                data[key] = measured
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
                os.replace(tmp, path)
            answer = data[key]
        finally:
            os.close(fd)
            lock.unlink(missing_ok=True)
    except OSError:
        return measured  # a read-only home: every process measures for itself
    return answer if isinstance(answer, int) else measured


def _lock(lock: Path, timeout_s: float = 10.0) -> int:
    """An exclusive lock file (O_EXCL); a stale one older than the timeout is taken over."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if time.monotonic() > deadline:
                lock.unlink(missing_ok=True)
            time.sleep(0.01)


def _cpu_identity() -> tuple[str, str]:
    """(model name, flags) of the first CPU: VMs often share one generic name across CPU generations."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields.get("model name", platform.processor() or platform.machine()), fields.get("flags", "")
