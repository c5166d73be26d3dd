"""One cost-model constant moved at a time, and what it does to the headline ratios.

Each variant reruns the four headline comparisons at a smaller scale: per-instance decode throughput
of AlignedServe over FastGen (synthetic 95 % short, OPT-2.7B) and over DistServe (Azure, OPT-13B), P99
TPOT of vLLM over AlignedServe (Azure) and the throughput lost without GPU prefetch (Azure).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from alignedserve.bench.paper.experiments import (
    ALIGNED,
    ALIGNED_NO_PREFETCH,
    DISTSERVE,
    FASTGEN,
    VLLM,
    Scale,
    System,
    app,
    decoding_instances,
    job,
    synthetic,
)
from alignedserve.bench.paper.jobs import CostSpec, Job, Summary


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    changes: dict[str, Any] = field(default_factory=dict)  # CostSpec fields
    only: str | None = None  # apply to this policy only (a what-if about one system)

    def cost(self, model: str, policy: str) -> CostSpec:
        base = CostSpec(model=model)
        return base if self.only not in (None, policy) else replace(base, **self.changes)


BASE = Variant("calibrated (every table above)")
VARIANTS = (
    BASE,
    Variant("HBM efficiency x0.8", {"hbm_efficiency_scale": 0.8}),
    Variant("HBM efficiency x1.2", {"hbm_efficiency_scale": 1.2}),
    Variant("per-CTA bandwidth x0.5", {"cta_bandwidth_scale": 0.5}),
    Variant("per-CTA bandwidth x2", {"cta_bandwidth_scale": 2.0}),
    Variant("compute efficiency 0.5", {"compute_efficiency": 0.5}),
    Variant("compute efficiency 1.0", {"compute_efficiency": 1.0}),
    Variant("PCIe x0.5", {"pcie_scale": 0.5}),
    Variant("PCIe x2", {"pcie_scale": 2.0}),
    Variant("NVLink x0.5", {"nvlink_scale": 0.5}),
    Variant("NVLink x2", {"nvlink_scale": 2.0}),
    Variant("KV memory share 0.8", {"memory_utilization": 0.8}),
    Variant("KV memory share 0.95", {"memory_utilization": 0.95}),
    Variant("public figures only (no fit, peak FLOP/s)", {"paperfit": False}),
    Variant("what-if: DistServe +10 ms host time a pass (Fig. 11)", {"host_overhead_s": 0.010}, "distserve"),
)

_SYNTHETIC = ("synthetic", "opt-2.7b", (ALIGNED, FASTGEN))
_AZURE = ("azure", "opt-13b", (ALIGNED, DISTSERVE, VLLM, ALIGNED_NO_PREFETCH))


def _key(variant: Variant, workload: str) -> str:
    return f"sens/{variant.name}/{workload}"


def sensitivity_jobs(scale: Scale) -> list[Job]:
    jobs = []
    for variant in VARIANTS:
        for name, model, systems in (_SYNTHETIC, _AZURE):
            workload = (
                synthetic(0.95, scale.sensitivity) if name == "synthetic" else app("azure", scale.sensitivity)
            )
            for s in systems:
                jobs.append(job(_key(variant, name), workload, model, s, variant.cost(model, s.policy)))
    return jobs


def _per_instance(results: dict[str, Summary], key: str, system: System, model: str) -> float:
    return float(results[f"{key}/{system.label}"]["decode_throughput_tok_s"]) / decoding_instances(
        system, model
    )


def headline_ratios(results: dict[str, Summary], variant: Variant) -> dict[str, float]:
    syn, az = _key(variant, "synthetic"), _key(variant, "azure")
    aligned_az = results[f"{az}/{ALIGNED.label}"]
    return {
        "H1": _per_instance(results, syn, ALIGNED, "opt-2.7b")
        / _per_instance(results, syn, FASTGEN, "opt-2.7b"),
        "H2": _per_instance(results, az, ALIGNED, "opt-13b")
        / _per_instance(results, az, DISTSERVE, "opt-13b"),
        "H3": float(results[f"{az}/{VLLM.label}"]["p99_tpot_ms"]) / float(aligned_az["p99_tpot_ms"]),
        "H4": 1.0
        - float(results[f"{az}/{ALIGNED_NO_PREFETCH.label}"]["decode_throughput_tok_s"])
        / float(aligned_az["decode_throughput_tok_s"]),
    }


HEADLINES = {
    "H1": ("throughput / decode instance, AlignedServe ÷ FastGen, 95 % short, OPT-2.7B", "1.85×"),
    "H2": ("throughput / decode instance, AlignedServe ÷ DistServe, Azure, OPT-13B", "≤ 1.98×"),
    "H3": ("P99 TPOT, vLLM ÷ AlignedServe, Azure, OPT-13B", "≤ 7.4×"),
    "H4": ("throughput lost without GPU prefetch, Azure, OPT-13B", "14.73 %"),
}
