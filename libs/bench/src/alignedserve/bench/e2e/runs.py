"""The workloads the experiments replay, and one benchmark run of a target, shared by the drivers.

Every target (AlignedServe in each mode, each peer server) gets exactly the same requests: the same
lengths from the same seed, the same prompts (built for the SmolLM2 tokenizer all targets share), and
the same arrival process. Lengths are scaled down to fit this machine (`length_scale`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from alignedserve.core.workloads.build import WorkloadConfig
from alignedserve.loadgen.client import ClientSettings
from alignedserve.loadgen.runner import BenchmarkConfig, BenchmarkResult, run_benchmark
from alignedserve.loadgen.tokenizer import load_tokenizer

TOKENIZER = "smollm2"  # every target serves SmolLM2-135M-Instruct


@dataclass(frozen=True, slots=True)
class RunScale:
    """How big a run is: requests per workload, length shrink factor, arrivals."""

    num_requests: int = 64
    length_scale: float = 0.25
    concurrency: int | None = 16  # closed loop (or the in-flight cap of a Poisson run)
    request_rate: float | None = None  # Poisson requests/s; None: closed loop at `concurrency`
    seed: int = 0
    max_input_len: int = 4096  # after scaling: keeps every prompt inside the model's 8k context
    max_output_len: int = 256

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give a concurrency (closed loop) or a request rate (Poisson)")

    def describe(self) -> str:
        if self.request_rate is not None:
            cap = f", at most {self.concurrency} in flight" if self.concurrency else ""
            arrivals = f"Poisson arrivals at {self.request_rate:g} req/s{cap}"
        else:
            arrivals = f"closed loop, {self.concurrency} in flight"
        return (
            f"{self.num_requests} requests per workload, lengths ×{self.length_scale:g} "
            f"(prompts ≤ {self.max_input_len}, outputs ≤ {self.max_output_len} tokens), {arrivals}, "
            f"seed {self.seed}"
        )


@dataclass(frozen=True, slots=True)
class BenchWorkload:
    name: str  # short id used in JSON and file names
    title: str  # what a reader sees in the tables
    config: WorkloadConfig


def standard_workloads(scale: RunScale) -> list[BenchWorkload]:
    """The paper's two shapes: the 95%-short synthetic mix and the Azure conversation trace."""
    common: dict[str, Any] = {
        "num_requests": scale.num_requests,
        "seed": scale.seed,
        "length_scale": scale.length_scale,
        "max_input_len": scale.max_input_len,
        "max_output_len": scale.max_output_len,
    }
    return [
        BenchWorkload(
            "synthetic95",
            "synthetic, 95% short",
            WorkloadConfig(source="synthetic", short_share=0.95, **common),
        ),
        BenchWorkload("azure-conv", "Azure conversation trace", WorkloadConfig(source="trace", **common)),
    ]


def select_workloads(scale: RunScale, names: list[str] | None) -> list[BenchWorkload]:
    available = standard_workloads(scale)
    if not names:
        return available
    by_name = {w.name: w for w in available}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {sorted(by_name)}")
    return [by_name[n] for n in names]


@dataclass(frozen=True, slots=True)
class Target:
    """An OpenAI-compatible endpoint and how to talk to it."""

    label: str  # row label: "aligned", "fcfs", "vllm-cpu", ...
    endpoint: str
    model: str = TOKENIZER
    ignore_eos: bool = True  # the server honours `ignore_eos` (outputs forced to max_tokens)
    extra_body: dict[str, Any] = field(default_factory=dict)


def benchmark_config(
    target: Target, workload: BenchWorkload, scale: RunScale, progress: bool
) -> BenchmarkConfig:
    client = ClientSettings(
        target.endpoint, target.model, ignore_eos=target.ignore_eos, extra_body=dict(target.extra_body)
    )
    return BenchmarkConfig(
        client,
        workload.config,
        request_rate=scale.request_rate,
        concurrency=scale.concurrency,
        tokenizer=TOKENIZER,
        on_length_mismatch="fail",  # every target must produce exactly the forced lengths
        progress=progress,
    )


def run_workload(
    target: Target, workload: BenchWorkload, scale: RunScale, progress: bool = True
) -> BenchmarkResult:
    """One workload through one target (blocking)."""
    config = benchmark_config(target, workload, scale, progress)
    return asyncio.run(run_benchmark(config, tokenizer=load_tokenizer(TOKENIZER)))


@dataclass(frozen=True, slots=True)
class RunRow:
    """One (target, workload) result: the load generator's summary plus server-side stats if any."""

    target: str
    workload: str
    summary: dict[str, Any]  # BenchmarkResult.to_json() without the per-request records
    server_stats: dict[str, float] = field(default_factory=dict)

    def get(self, key: str) -> float | None:
        value = self.summary.get(key)
        return float(value) if isinstance(value, int | float) else None


def row_from(
    target: str, workload: str, result: BenchmarkResult, stats: dict[str, float] | None = None
) -> RunRow:
    summary = {k: v for k, v in result.to_json().items() if k != "requests"}
    return RunRow(target, workload, summary, dict(stats or {}))
