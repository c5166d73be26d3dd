"""Public figures of the accelerators and models the GPU cost models are built from, each with its source.

Nothing here is fitted to a result the simulator predicts. `SOURCES` names where every constant comes
from; `alignedserve bench paper` prints it as the provenance table of docs/paper-vs-sim.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Public figures of an accelerator."""

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    dense_flops: float  # bf16/fp16 dense tensor FLOP/s
    sm_count: int
    pcie_bytes_per_s: float  # effective, one way
    nvlink_bytes_per_s: float  # one way
    memory_utilization: float = 0.9  # share of HBM a serving engine takes (vLLM's default)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Public architecture figures of a model (16-bit weights)."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int  # query heads = attention CTAs per sequence per layer
    kv_bytes_per_token: int
    bytes_per_param: int = 2


def kv_bytes(layers: int, hidden: int, bytes_per_value: int = 2) -> int:
    """K and V of every layer for one token, multi-head attention: 2 · layers · hidden values."""
    return 2 * layers * hidden * bytes_per_value


H100_SXM = GpuSpec(
    name="h100",
    hbm_bytes=80 * 2**30,
    hbm_bytes_per_s=3.35e12,
    dense_flops=990e12,
    sm_count=132,
    pcie_bytes_per_s=50e9,
    nvlink_bytes_per_s=450e9,
)
LLAMA_7B = ModelSpec(
    "llama-7b", params=6.74e9, layers=32, hidden=4096, heads=32, kv_bytes_per_token=kv_bytes(32, 4096)
)
# OPT (Zhang et al. 2022, Table 1; the Hugging Face facebook/opt-* configs): layers, d_model, heads;
# parameter counts from those configs (embeddings and biases included)
OPT_2_7B = ModelSpec(
    "opt-2.7b", params=2.65e9, layers=32, hidden=2560, heads=32, kv_bytes_per_token=kv_bytes(32, 2560)
)
OPT_6_7B = ModelSpec(
    "opt-6.7b", params=6.66e9, layers=32, hidden=4096, heads=32, kv_bytes_per_token=kv_bytes(32, 4096)
)
OPT_13B = ModelSpec(
    "opt-13b", params=12.85e9, layers=40, hidden=5120, heads=40, kv_bytes_per_token=kv_bytes(40, 5120)
)
OPT_30B = ModelSpec(
    "opt-30b", params=29.97e9, layers=48, hidden=7168, heads=56, kv_bytes_per_token=kv_bytes(48, 7168)
)
OPT_MODELS = {m.name: m for m in (OPT_2_7B, OPT_6_7B, OPT_13B, OPT_30B)}

# Share of peak tensor FLOP/s a large fp16 kernel sustains on an H100: FlashAttention-3 (Shah et al.
# 2024, arXiv:2407.08608) reports up to 740 TFLOP/s FP16, 75 % of the 989 TFLOP/s peak.
H100_COMPUTE_EFFICIENCY = 0.75

SOURCES: dict[str, str] = {
    "hbm_bytes": "H100 SXM5 datasheet (NVIDIA): 80 GB HBM3",
    "hbm_bytes_per_s": "H100 SXM5 datasheet: 3.35 TB/s",
    "dense_flops": "H100 SXM5 datasheet: 989 TFLOP/s dense FP16/BF16 tensor (1,979 with sparsity)",
    "sm_count": "NVIDIA H100 whitepaper (Hopper architecture): 132 SMs on the SXM5 part",
    "pcie_bytes_per_s": "PCIe 5.0 x16: 64 GB/s raw one way, ~50 GB/s after encoding and protocol overhead",
    "nvlink_bytes_per_s": "H100 SXM5 datasheet: NVLink 900 GB/s bidirectional = 450 GB/s one way",
    "memory_utilization": "vLLM `gpu_memory_utilization` default 0.9 (DistServe's evaluation: 0.92)",
    "compute_efficiency": "FlashAttention-3 (Shah et al. 2024): 740 TFLOP/s FP16 on H100 = 75 % of peak",
    "opt_shapes": "OPT (Zhang et al. 2022) Table 1 and the facebook/opt-* model configs",
    "attention_fit": "the paper's motivating experiment (vLLM, Llama-7B, H100): 13.49 ms and 21.73 ms "
    "iterations; two unknowns (HBM efficiency, per-CTA bandwidth) solved from exactly those two points",
}
