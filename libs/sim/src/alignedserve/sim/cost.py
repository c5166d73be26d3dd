"""Cost models: how long a decode iteration, a prefill pass and a KV transfer take on some hardware.

Every model answers the same five questions (the `CostModel` protocol), so the simulator never branches
on hardware. GPU models are built only from public figures (see `GpuSpec`, `ModelSpec` and
docs/simulator.md for the derivation); the CPU model is fitted from measurements (`cpu_model.py`);
`cost_registry.py` names them all.

Decode on a GPU = a linear part (every weight read once per iteration, 2·params FLOPs per token) plus an
attention part that is memory-bound (~1 FLOP per KV byte, far below the ridge) and parallel *per
sequence*: a sequence's attention runs as one CTA per head, each CTA on one SM, and an SM draws at most
its 1/n_SM share of HBM bandwidth. So one sequence can pull at most heads/n_SM of the chip's bandwidth.
All sequences share the chip fairly (fluid processor sharing with that per-sequence cap); when many are
active they saturate HBM and the time is the sum of their KV bytes over the bandwidth; when only a few
long ones remain they cannot fill the chip and the time is governed by the longest — the bubble.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class Link(Enum):
    """The paths KV bytes take between devices."""

    PCIE = "pcie"  # host pool <-> any GPU
    NVLINK = "nvlink"  # prefill GPU <-> decode GPU


@dataclass(frozen=True, slots=True)
class SpanCost:
    """Durations of consecutive decode iterations while the batch is unchanged: t_j = first_s + j·step_s."""

    first_s: float
    step_s: float  # each iteration every prefix is one token longer

    def total(self, iterations: int) -> float:
        """Sum of the first `iterations` durations."""
        k = iterations
        return k * self.first_s + self.step_s * k * (k - 1) / 2.0

    def iterations_within(self, budget_s: float) -> int:
        """Largest k with total(k) <= budget_s (k >= 0)."""
        if budget_s <= 0:
            return 0
        a, b = self.first_s, self.step_s
        if b <= 1e-18:
            k = int(budget_s // a)
        else:
            # b/2·k² + (a - b/2)·k - budget = 0
            half = b / 2.0
            lin = a - half
            k = int((-lin + math.sqrt(lin * lin + 4.0 * half * budget_s)) / (2.0 * half))
        while k > 0 and self.total(k) > budget_s:
            k -= 1
        while self.total(k + 1) <= budget_s:
            k += 1
        return k


class CostModel(Protocol):
    """What the simulator asks of a hardware + model pair."""

    name: str
    block_size: int  # tokens per KV block
    kv_bytes_per_token: int

    @property
    def decode_capacity_blocks(self) -> int:
        """B_max: KV blocks one decode worker holds (device memory minus weights and reserve)."""
        ...

    def decode_iteration_s(self, kv_lens: Sequence[int]) -> float:
        """One decode iteration of a batch whose sequences attend over `kv_lens` tokens each."""
        ...

    def decode_span(self, kv_lens: Sequence[int]) -> SpanCost:
        """Durations of this iteration and the following ones, every kv_len growing by one a step."""
        ...

    def prefill_s(self, input_lens: Sequence[int]) -> float:
        """One prefill pass over these prompts (batched)."""
        ...

    def transfer_s(self, blocks: int, link: Link) -> float:
        """Moving `blocks` KV blocks over `link`."""
        ...


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Public figures of an accelerator."""

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    dense_flops: float  # bf16 dense tensor FLOP/s
    sm_count: int
    pcie_bytes_per_s: float  # effective, one way
    nvlink_bytes_per_s: float  # one way
    memory_utilization: float = 0.9  # share of HBM a serving engine takes (vLLM's default)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Public architecture figures of a model (bf16 weights)."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int  # query heads = attention CTAs per sequence per layer
    kv_bytes_per_token: int
    bytes_per_param: int = 2


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
    "llama-7b", params=6.74e9, layers=32, hidden=4096, heads=32, kv_bytes_per_token=512 * 1024
)
OPT_13B = ModelSpec(
    "opt-13b", params=12.85e9, layers=40, hidden=5120, heads=40, kv_bytes_per_token=800 * 1024
)


@dataclass(frozen=True, slots=True)
class AttentionFit:
    """Two numbers the public figures do not give, fitted from measured iteration times."""

    bandwidth_efficiency: float  # share of peak HBM bandwidth a decode iteration achieves
    cta_bytes_per_s: float  # HBM bandwidth one attention CTA (one sequence, one head) draws alone


class GpuCostModel:
    """Roofline decode/prefill model with per-sequence attention parallelism (the bubble).

    Without a fit: peak bandwidth, and a CTA draws at most its SM's 1/n_SM share of it.
    """

    def __init__(
        self, gpu: GpuSpec, model: ModelSpec, block_size: int = 16, fit: AttentionFit | None = None
    ) -> None:
        self.name = f"{gpu.name}-{model.name}" + ("-paperfit" if fit else "")
        self.gpu = gpu
        self.model = model
        self.block_size = block_size
        self.fit = fit
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self._weight_bytes = model.params * model.bytes_per_param
        efficiency = fit.bandwidth_efficiency if fit else 1.0
        self._hbm_bytes_per_s = gpu.hbm_bytes_per_s * efficiency
        cta = fit.cta_bytes_per_s if fit else gpu.hbm_bytes_per_s / gpu.sm_count
        # most HBM bandwidth one sequence can draw: its `heads` CTAs together
        self._seq_bytes_per_s = min(model.heads * cta, self._hbm_bytes_per_s)

    @property
    def decode_capacity_blocks(self) -> int:
        free = self.gpu.hbm_bytes * self.gpu.memory_utilization - self._weight_bytes
        return max(0, int(free // (self.block_size * self.kv_bytes_per_token)))

    def linear_s(self, batch: int) -> float:
        """Weights and MLP/projections: compute- or weight-read-bound, whichever is slower."""
        compute = 2.0 * self.model.params * batch / self.gpu.dense_flops
        return max(compute, self._weight_bytes / self._hbm_bytes_per_s)

    def attention_s(self, kv_lens: Sequence[int]) -> float:
        """Fluid fair sharing of HBM bandwidth, each sequence capped at `_seq_bytes_per_s`.

        Sorted by length, phase k runs while the k-th shortest sequence still has work; n - k sequences
        are active, each at min(cap, BW / active). Many active: the sum of bytes over BW. Few, long: the
        longest over its cap.
        """
        ordered = sorted(kv_lens)
        n = len(ordered)
        bw, cap, per_token = self._hbm_bytes_per_s, self._seq_bytes_per_s, self.kv_bytes_per_token
        total, done = 0.0, 0
        for k, length in enumerate(ordered):
            if length > done:
                total += (length - done) * per_token / min(cap, bw / (n - k))
                done = length
        return total

    def decode_iteration_s(self, kv_lens: Sequence[int]) -> float:
        if not kv_lens:
            return 0.0
        return self.linear_s(len(kv_lens)) + self.attention_s(kv_lens)

    def decode_span(self, kv_lens: Sequence[int]) -> SpanCost:
        # one more token for everyone lengthens only the first phase (all n active); the later phases
        # depend on length differences, which do not change
        n = len(kv_lens)
        if n == 0:
            return SpanCost(0.0, 0.0)
        step = self.kv_bytes_per_token / min(self._seq_bytes_per_s, self._hbm_bytes_per_s / n)
        return SpanCost(self.decode_iteration_s(kv_lens), step)

    def prefill_s(self, input_lens: Sequence[int]) -> float:
        """Compute-bound: 2·params FLOPs a token plus causal attention 2·layers·hidden·n² a prompt."""
        tokens = sum(input_lens)
        if tokens == 0:
            return 0.0
        attention = 2.0 * self.model.layers * self.model.hidden * sum(n * n for n in input_lens)
        flops = 2.0 * self.model.params * tokens + attention
        return max(flops / self.gpu.dense_flops, self._weight_bytes / self._hbm_bytes_per_s)

    def transfer_s(self, blocks: int, link: Link) -> float:
        rate = self.gpu.pcie_bytes_per_s if link is Link.PCIE else self.gpu.nvlink_bytes_per_s
        return blocks * self.block_size * self.kv_bytes_per_token / rate


# --- the paper's measured iterations (vLLM, H100, Llama-7B), and the fit they allow --------------------

# 64 requests of 32-token prompts after 600 generated tokens: every sequence attends over 632 tokens
PAPER_ALIGNED_KV_LENS: tuple[int, ...] = (632,) * 64
PAPER_ALIGNED_S = 13.49e-3
# the same with 4 of them 4096-token prompts (4096 + 600)
PAPER_MIXED_KV_LENS: tuple[int, ...] = (632,) * 60 + (4696,) * 4
PAPER_MIXED_S = 21.73e-3


def _bisect(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Root of a monotone f on [lo, hi] (geometric bisection: the unknowns span decades)."""
    f_lo = f(lo)
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if (f(mid) > 0) == (f_lo > 0):
            lo, f_lo = mid, f(mid)
        else:
            hi = mid
    return math.sqrt(lo * hi)


def fit_attention(gpu: GpuSpec, model: ModelSpec) -> AttentionFit:
    """Fit HBM efficiency to the aligned point and the per-CTA bandwidth to the mixed point.

    Both are properties of the GPU and the attention kernel, so the fit made on Llama-7B carries to
    other models (a sequence of an H-head model runs H CTAs). Alternates until both points agree.
    """
    fit = AttentionFit(1.0, gpu.hbm_bytes_per_s)
    for _ in range(5):
        cta = fit.cta_bytes_per_s

        def aligned_gap(eff: float, cta: float = cta) -> float:
            model_s = GpuCostModel(gpu, model, fit=AttentionFit(eff, cta)).decode_iteration_s(
                PAPER_ALIGNED_KV_LENS
            )
            return model_s - PAPER_ALIGNED_S

        eff = _bisect(aligned_gap, 0.01, 1.0)

        def mixed_gap(cta: float, eff: float = eff) -> float:
            model_s = GpuCostModel(gpu, model, fit=AttentionFit(eff, cta)).decode_iteration_s(
                PAPER_MIXED_KV_LENS
            )
            return model_s - PAPER_MIXED_S

        fit = AttentionFit(eff, _bisect(mixed_gap, 1e8, gpu.hbm_bytes_per_s))
    return fit
