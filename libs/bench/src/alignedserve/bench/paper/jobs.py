"""One simulation = one `Job` (workload flags, system, cost-model variant); `run_jobs` runs many in worker
processes and returns each job's JSON summary by key."""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.sim.cli import build_workload, parse_args, run_spec, simulate
from alignedserve.sim.cost import AttentionFit, CostModel, GpuCostModel
from alignedserve.sim.cost_registry import PAPER_MODELS, paper_attention_fit
from alignedserve.sim.hardware import H100_COMPUTE_EFFICIENCY, H100_SXM
from alignedserve.sim.overhead import HostOverhead

Summary = dict[str, Any]


@dataclass(frozen=True, slots=True)
class CostSpec:
    """A GPU cost model of the paper's setting, with any of its constants moved (sensitivity)."""

    model: str = "opt-13b"  # a key of cost_registry.PAPER_MODELS
    paperfit: bool = True
    hbm_efficiency_scale: float = 1.0
    cta_bandwidth_scale: float = 1.0
    compute_efficiency: float | None = None  # None: the model's own (0.75 calibrated, 1.0 public)
    pcie_scale: float = 1.0
    nvlink_scale: float = 1.0
    memory_utilization: float | None = None
    host_overhead_s: float = 0.0  # what-if only (overhead.py)

    def build(self) -> CostModel:
        spec, tp = PAPER_MODELS[self.model]
        gpu = replace(
            H100_SXM,
            pcie_bytes_per_s=H100_SXM.pcie_bytes_per_s * self.pcie_scale,
            nvlink_bytes_per_s=H100_SXM.nvlink_bytes_per_s * self.nvlink_scale,
            memory_utilization=self.memory_utilization or H100_SXM.memory_utilization,
        )
        base = (
            paper_attention_fit() if self.paperfit else AttentionFit(1.0, gpu.hbm_bytes_per_s / gpu.sm_count)
        )
        moved = self.hbm_efficiency_scale != 1.0 or self.cta_bandwidth_scale != 1.0
        fit = (
            AttentionFit(
                min(1.0, base.bandwidth_efficiency * self.hbm_efficiency_scale),
                base.cta_bytes_per_s * self.cta_bandwidth_scale,
            )
            if self.paperfit or moved
            else None
        )
        default_efficiency = H100_COMPUTE_EFFICIENCY if self.paperfit else 1.0
        cost: CostModel = GpuCostModel(
            gpu,
            spec,
            fit=fit,
            tensor_parallel=tp,
            compute_efficiency=self.compute_efficiency or default_efficiency,
        )
        return HostOverhead(cost, self.host_overhead_s) if self.host_overhead_s else cost


@dataclass(frozen=True, slots=True)
class Job:
    key: str
    argv: tuple[str, ...]  # `alignedserve sim` workload and cluster flags
    policy: str  # aligned | fcfs | a baseline
    prefetch: bool = True
    cost: CostSpec = field(default_factory=CostSpec)


@lru_cache(maxsize=8)
def _workload(argv: tuple[str, ...]) -> tuple[RequestSpec, ...]:
    return tuple(build_workload(parse_args(list(argv))))


def run_job(job: Job) -> tuple[str, Summary]:
    args = parse_args(list(job.argv))
    specs = list(_workload(job.argv))
    started = time.perf_counter()
    summary: Summary = dict(simulate(specs, job.cost.build(), run_spec(args, job.policy, job.prefetch)))
    summary["job_wall_s"] = time.perf_counter() - started
    return job.key, summary


def run_jobs(jobs: Sequence[Job], processes: int, progress: bool = True) -> dict[str, Summary]:
    """Every job's summary by key; `processes` worker processes (1: in this process)."""
    keys = [j.key for j in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError("job keys must be unique")
    results: dict[str, Summary] = {}
    started = time.perf_counter()
    if processes <= 1:
        done = map(run_job, jobs)
        for key, summary in done:
            results[key] = summary
            _report(progress, len(results), len(jobs), key, started)
        return results
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for key, summary in pool.imap_unordered(run_job, jobs):
            results[key] = summary
            _report(progress, len(results), len(jobs), key, started)
    return results


def _report(progress: bool, done: int, total: int, key: str, started: float) -> None:
    if progress:
        print(f"[{time.perf_counter() - started:6.1f} s] {done}/{total} {key}", file=sys.stderr, flush=True)
