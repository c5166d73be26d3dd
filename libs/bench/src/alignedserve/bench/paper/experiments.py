"""The paper's evaluation experiments (arXiv:2605.23389, §6; ../shared/paper/), as simulator jobs.

Protocol (docs/paper-vs-sim.md says why): throughput experiments send the whole workload at t = 0 (an
offline batch: every system saturated, nothing deferred past a window) and count decode tokens over the
time to drain all of it; latency experiments (TTFT, waits, pool memory) use Poisson arrivals at a
load the aligned system sustains. Every system runs on the same 8 H100s: 4 + 4 one-GPU instances
(OPT-30B: 2 + 2 two-GPU instances).
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.bench.paper.jobs import CostSpec, Job
from alignedserve.sim.cost_registry import PAPER_MODELS

GPUS = 8


@dataclass(frozen=True, slots=True)
class System:
    label: str
    policy: str
    extra: tuple[str, ...] = ()
    prefetch: bool = True

    @property
    def colocated(self) -> bool:
        return self.policy in ("vllm", "vllm-nochunk", "fastgen")


ALIGNED = System("AlignedServe", "aligned")
ALIGNED_PAPER_RULE = System("AlignedServe, paper's admission rule", "aligned", ("--growth-reserve", "0"))
FCFS = System("fcfs (same stack)", "fcfs")
DISTSERVE = System("DistServe", "distserve")
VLLM = System("vLLM (chunked prefill)", "vllm")
VLLM_NOCHUNK = System("vLLM (no chunking)", "vllm-nochunk")
FASTGEN = System("DeepSpeed-FastGen", "fastgen")
ALIGNED_NO_PREFETCH = System("AlignedServe, prefetch off", "aligned", prefetch=False)
FCFS_NO_PREFETCH = System("fcfs, prefetch off", "fcfs", prefetch=False)
BASELINES = (DISTSERVE, VLLM, VLLM_NOCHUNK, FASTGEN)
SYSTEMS = (ALIGNED, ALIGNED_PAPER_RULE, FCFS, *BASELINES)
BY_POLICY = {s.policy: s for s in SYSTEMS if s is not ALIGNED_PAPER_RULE}


@dataclass(frozen=True, slots=True)
class Scale:
    """Request counts per experiment (`full` for docs/paper-vs-sim.md, `tiny` for the test)."""

    name: str
    synthetic: int
    apps: int  # ShareGPT-like and the Azure trace (its first N requests)
    longbench: int
    forward: int
    latency_sharegpt: int
    latency_longbench: int
    sensitivity: int


# sized so that `make paper` stays within 15 minutes on a shared 2-core machine (~650 CPU-seconds); an
# offline run of 8,000 requests already fills every instance for hundreds of batches
FULL = Scale("full", 8_000, 10_000, 3_000, 1_500, 6_000, 1_000, 3_000)
TINY = Scale("tiny", 150, 150, 60, 40, 120, 40, 100)
SCALES = {s.name: s for s in (FULL, TINY)}
SHORT_SHARES = (0.5, 0.7, 0.8, 0.9, 0.95)
MODELS = ("opt-2.7b", "opt-6.7b", "opt-13b", "opt-30b")
APP_MODELS = ("opt-2.7b", "opt-13b")
FORWARD_LONG = (2000, 4000, 6000, 8000, 10000)
AGING_S = 5.0  # starvation threshold of the latency runs with aging on


def instances(model: str) -> tuple[int, int]:
    """(prefill, decode) instances of `model` on the 8 GPUs."""
    _, tp = PAPER_MODELS[model]
    half = GPUS // tp // 2
    return half, half


def decoding_instances(system: System, model: str) -> int:
    prefill, decode = instances(model)
    return prefill + decode if system.colocated else decode


def _cluster(model: str) -> tuple[str, ...]:
    prefill, decode = instances(model)
    return ("--prefill-workers", str(prefill), "--decode-workers", str(decode))


def job(key: str, workload: tuple[str, ...], model: str, system: System, cost: CostSpec | None = None) -> Job:
    return Job(
        key=f"{key}/{system.label}",
        argv=(*workload, *_cluster(model), *system.extra),
        policy=system.policy,
        prefetch=system.prefetch,
        cost=cost or CostSpec(model=model),
    )


def synthetic(share: float, n: int) -> tuple[str, ...]:
    return ("--workload", "synthetic", "--short-share", str(share), "--requests", str(n))


def app(name: str, n: int) -> tuple[str, ...]:
    """An application workload as an offline batch (the trace's lengths, in trace order)."""
    if name == "azure":
        return ("--workload", "azure", "--requests", str(n), "--time-scale", "0")
    return ("--workload", name, "--requests", str(n))


def app_n(name: str, scale: Scale) -> int:
    return scale.longbench if name == "longbench" else scale.apps


# --- the experiments ------------------------------------------------------------------------------


def synthetic_jobs(scale: Scale) -> list[Job]:
    """Fig. 7 / 9: synthetic short/long mixes on OPT-2.7B; the 95 % mix on every model."""
    jobs = [
        job(f"synthetic/opt-2.7b/{share}", synthetic(share, scale.synthetic), "opt-2.7b", s)
        for share in SHORT_SHARES
        for s in SYSTEMS
    ]
    jobs += [
        job(f"synthetic/{model}/0.95", synthetic(0.95, scale.synthetic), model, s)
        for model in MODELS
        if model != "opt-2.7b"
        for s in SYSTEMS
    ]
    return jobs


def app_jobs(scale: Scale) -> list[Job]:
    """Fig. 8 / 10 / 13 / 14: ShareGPT-like, LongBench-like and the Azure trace; the prefetch ablation."""
    jobs = [
        job(f"apps/{model}/{name}", app(name, app_n(name, scale)), model, s)
        for model in APP_MODELS
        for name in ("sharegpt", "longbench", "azure")
        for s in SYSTEMS
    ]
    jobs += [
        job(f"apps/{model}/azure", app("azure", scale.apps), model, s)
        for model in APP_MODELS
        for s in (ALIGNED_NO_PREFETCH, FCFS_NO_PREFETCH)
    ]
    return jobs


def forward_jobs(scale: Scale) -> list[Job]:
    """Fig. 12: forward latency with 95 % long requests, the long ones growing from 2,000 to 10,000."""
    return [
        job(
            f"forward/opt-13b/{length}",
            (*synthetic(0.05, scale.forward), "--long-range", str(length * 9 // 10), str(length)),
            "opt-13b",
            s,
        )
        for length in FORWARD_LONG
        for s in (ALIGNED, FCFS, DISTSERVE, VLLM, FASTGEN)
    ]


LATENCY_RATES = {"sharegpt": 30.0, "longbench": 3.5}  # requests/s: ~70-80 % of what aligned sustains


def latency_jobs(scale: Scale) -> list[Job]:
    """Fig. 15 and the pool memory: TTFT, max wait with and without aging, KV-pool peak, switch-overs."""
    jobs = []
    for name, rate in LATENCY_RATES.items():
        n = scale.latency_sharegpt if name == "sharegpt" else scale.latency_longbench
        workload = ("--workload", name, "--requests", str(n), "--rate", str(rate))
        aging = System("AlignedServe, aging 5 s", "aligned", ("--starvation-s", str(AGING_S)))
        for s in (ALIGNED, aging, ALIGNED_PAPER_RULE, FCFS, DISTSERVE, VLLM):
            jobs.append(job(f"latency/opt-13b/{name}", workload, "opt-13b", s))
    return jobs
