"""Workload transforms: each returns a new list and leaves its input alone."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace

from alignedserve.core.workloads.spec import RequestSpec, check_count


def poisson_times(n: int, rate: float, seed: int) -> list[float]:
    """`n` arrival times of a Poisson process of `rate` requests/s, the first at t=0."""
    check_count(n)
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def scaled_times(times: Sequence[float], factor: float) -> list[float]:
    """Arrival times multiplied by `factor` (0.5 = twice the request rate)."""
    if not factor >= 0 or not math.isfinite(factor):
        raise ValueError(f"time scale must be a finite number >= 0, got {factor}")
    return [t * factor for t in times]


def with_poisson_arrivals(specs: Sequence[RequestSpec], rate: float, seed: int) -> list[RequestSpec]:
    """Replace arrival times by a Poisson process of `rate` requests/s (first arrival at t=0)."""
    return with_times(specs, poisson_times(len(specs), rate, seed))


def scale_time(specs: Sequence[RequestSpec], factor: float) -> list[RequestSpec]:
    """Multiply arrival times by `factor` (0.5 = twice the request rate)."""
    return with_times(specs, scaled_times([s.arrival_s for s in specs], factor))


def with_times(specs: Sequence[RequestSpec], times: Sequence[float]) -> list[RequestSpec]:
    """The requests with these arrival times (one a request)."""
    return [replace(s, arrival_s=t) for s, t in zip(specs, times, strict=True)]


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
    check_count(n)
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


def cap_lengths(
    specs: Sequence[RequestSpec], max_input: int | None, max_output: int | None
) -> list[RequestSpec]:
    """Clip prompt and output lengths to `max_input` / `max_output` tokens (None: no cap)."""
    for name, cap in (("max input length", max_input), ("max output length", max_output)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1, got {cap}")
    return [
        replace(
            s,
            input_len=s.input_len if max_input is None else min(s.input_len, max_input),
            output_len=s.output_len if max_output is None else min(s.output_len, max_output),
        )
        for s in specs
    ]
