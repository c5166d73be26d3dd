"""Which requests to send and when: a workload source, length transforms, and an arrival process.

Lengths come from `alignedserve.core.workloads` (shared with the simulator). The arrival process is a
strategy: trace timestamps, Poisson, or closed loop; each gives every request a send time and may cap
how many are in flight at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

from alignedserve.core import workloads
from alignedserve.core.workloads import RequestSpec

WorkloadSource = Literal["synthetic", "trace", "sharegpt", "longbench"]
DEFAULT_NUM_REQUESTS = 200


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    source: WorkloadSource = "synthetic"
    num_requests: int = DEFAULT_NUM_REQUESTS
    seed: int = 0
    short_share: float = 0.95  # synthetic only
    short_range: tuple[int, int] = (16, 999)
    long_range: tuple[int, int] = (1000, 8000)
    output_range: tuple[int, int] = (16, 512)
    trace_path: Path | None = None  # None: the packaged Azure conversation trace
    length_scale: float = 1.0  # shrink (or grow) every prompt and output length
    max_input_len: int | None = None
    max_output_len: int | None = None


def source_specs(config: WorkloadConfig) -> list[RequestSpec]:
    """The first `num_requests` of the source (a trace repeats past its end), lengths unscaled."""
    n = config.num_requests
    if config.source == "synthetic":
        return workloads.synthetic(
            n, config.short_share, config.seed, config.short_range, config.long_range, config.output_range
        )
    if config.source == "trace":
        path = config.trace_path if config.trace_path is not None else workloads.default_trace_path()
        return workloads.take(workloads.read_trace(path), n)
    if config.source == "sharegpt":
        return workloads.sharegpt_like(n, config.seed)
    if config.source == "longbench":
        return workloads.longbench_like(n, config.seed)
    raise ValueError(f"unknown workload source {config.source!r}")


def cap_lengths(specs: list[RequestSpec], max_input: int | None, max_output: int | None) -> list[RequestSpec]:
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


def build_specs(config: WorkloadConfig) -> list[RequestSpec]:
    """Source -> length scale -> caps. Arrival times are still the source's (trace) or 0."""
    specs = source_specs(config)
    if config.length_scale != 1.0:
        specs = workloads.scale_lengths(specs, config.length_scale)
    return cap_lengths(specs, config.max_input_len, config.max_output_len)


class ArrivalProcess(Protocol):
    """When each request is sent (`arrival_s`, seconds after the run starts) and the in-flight cap."""

    @property
    def max_in_flight(self) -> int | None: ...

    def schedule(self, specs: list[RequestSpec]) -> list[RequestSpec]: ...

    def describe(self) -> dict[str, float | int | str | None]: ...


@dataclass(frozen=True, slots=True)
class TraceTimestamps:
    """Replay the workload's own arrival times, multiplied by `time_scale` (0.5 = twice the rate)."""

    time_scale: float = 1.0
    max_in_flight: int | None = None

    def schedule(self, specs: list[RequestSpec]) -> list[RequestSpec]:
        return workloads.scale_time(specs, self.time_scale)

    def describe(self) -> dict[str, float | int | str | None]:
        return {"arrivals": "trace", "time_scale": self.time_scale, "max_concurrency": self.max_in_flight}


@dataclass(frozen=True, slots=True)
class PoissonArrivals:
    """Open loop: exponential gaps at `rate` requests/s (inf: all at once), optionally capped in flight."""

    rate: float
    seed: int = 0
    max_in_flight: int | None = None

    def schedule(self, specs: list[RequestSpec]) -> list[RequestSpec]:
        if math.isinf(self.rate) and self.rate > 0:
            return [replace(s, arrival_s=0.0) for s in specs]
        return workloads.with_poisson_arrivals(specs, self.rate, self.seed)

    def describe(self) -> dict[str, float | int | str | None]:
        return {"arrivals": "poisson", "request_rate": self.rate, "max_concurrency": self.max_in_flight}


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """`concurrency` requests in flight; each completion sends the next one at once."""

    concurrency: int

    @property
    def max_in_flight(self) -> int | None:
        return self.concurrency

    def schedule(self, specs: list[RequestSpec]) -> list[RequestSpec]:
        return [replace(s, arrival_s=0.0) for s in specs]

    def describe(self) -> dict[str, float | int | str | None]:
        return {"arrivals": "closed_loop", "max_concurrency": self.concurrency}


def choose_arrivals(
    source: WorkloadSource,
    request_rate: float | None,
    concurrency: int | None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> ArrivalProcess:
    """--request-rate wins (Poisson, capped by --concurrency if given); else --concurrency is a closed
    loop; else a trace replays its timestamps. A generated workload needs one of the two flags."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if request_rate is not None:
        if not request_rate > 0:
            raise ValueError(f"request rate must be > 0 requests/s (or inf), got {request_rate}")
        return PoissonArrivals(request_rate, seed, concurrency)
    if concurrency is not None:
        return ClosedLoop(concurrency)
    if source == "trace":
        return TraceTimestamps(time_scale)
    raise ValueError(
        f"the {source} workload has no timestamps: give --request-rate R (Poisson; inf = all at once) "
        "or --concurrency C (closed loop)"
    )
