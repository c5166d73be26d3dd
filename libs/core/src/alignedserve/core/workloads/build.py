"""The request list of a run: source -> length scale -> caps. The load generator sends it and the
simulator replays it, so both see exactly the same lengths for the same config and seed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.synthetic import longbench_like, sharegpt_like, synthetic
from alignedserve.core.workloads.traces import default_trace_path, read_trace
from alignedserve.core.workloads.transforms import cap_lengths, scale_lengths, take

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
        return synthetic(
            n, config.short_share, config.seed, config.short_range, config.long_range, config.output_range
        )
    if config.source == "trace":
        path = config.trace_path if config.trace_path is not None else default_trace_path()
        return take(read_trace(path), n)
    if config.source == "sharegpt":
        return sharegpt_like(n, config.seed)
    if config.source == "longbench":
        return longbench_like(n, config.seed)
    raise ValueError(f"unknown workload source {config.source!r}")


def build_specs(config: WorkloadConfig) -> list[RequestSpec]:
    """Source -> length scale -> caps. Arrival times are still the source's (trace) or 0: an arrival
    process (`arrivals.py`) decides when each request is sent."""
    specs = source_specs(config)
    if config.length_scale != 1.0:
        specs = scale_lengths(specs, config.length_scale)
    return cap_lengths(specs, config.max_input_len, config.max_output_len)
