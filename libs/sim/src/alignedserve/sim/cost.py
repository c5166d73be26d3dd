"""Cost models: how long a decode iteration, a prefill pass and a KV transfer take on some hardware.

Every model answers the same questions (the `CostModel` protocol), so the simulator never branches
on hardware. GPU models are built only from public figures (`hardware.py`, each with its source; see
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

from alignedserve.sim.hardware import H100_SXM, LLAMA_7B, OPT_13B, GpuSpec, ModelSpec


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

    def decode_parts(self, kv_lens: Sequence[int]) -> DecodeParts:
        """Where one decode iteration's time goes (linear part, attention at full parallelism)."""
        ...

    def prefill_s(self, input_lens: Sequence[int]) -> float:
        """One prefill pass over these prompts (batched)."""
        ...

    def step_s(self, kv_lens: Sequence[int], chunks: Sequence[tuple[int, int]]) -> float:
        """One forward pass of a co-located engine: decodes attending over `kv_lens` tokens each, plus
        prefill chunks `(context already in KV, new tokens)` (chunked prefill, Dynamic SplitFuse)."""
        ...

    def transfer_s(self, blocks: int, link: Link) -> float:
        """Moving `blocks` KV blocks over `link`."""
        ...


@dataclass(frozen=True, slots=True)
class DecodeParts:
    """A decode iteration split by cause: `linear_s` (weights, MLP, projections) and `ideal_attention_s`
    (every KV byte read at the chip's full bandwidth). What the iteration takes beyond their sum is the
    bubble: few long sequences that cannot fill the chip. `ideal_step_s`: how much the ideal attention
    grows per iteration of a span (every sequence one token longer)."""

    linear_s: float
    ideal_attention_s: float
    ideal_step_s: float


@dataclass(frozen=True, slots=True)
class AttentionFit:
    """Two numbers the public figures do not give, fitted from measured iteration times."""

    bandwidth_efficiency: float  # share of peak HBM bandwidth a decode iteration achieves
    cta_bytes_per_s: float  # HBM bandwidth one attention CTA (one sequence, one head) draws alone


class GpuCostModel:
    """Roofline decode/prefill model with per-sequence attention parallelism (the bubble).

    Without a fit: peak bandwidth, and a CTA draws at most its SM's 1/n_SM share of it.
    `tensor_parallel` t: one instance spans t GPUs (Megatron-style: weights, heads and KV split t ways,
    two all-reduces of the activations per layer over NVLink). `compute_efficiency`: share of the peak
    tensor FLOP/s that compute-bound work (prefill, large batches) sustains.
    """

    def __init__(
        self,
        gpu: GpuSpec,
        model: ModelSpec,
        block_size: int = 16,
        fit: AttentionFit | None = None,
        tensor_parallel: int = 1,
        compute_efficiency: float = 1.0,
    ) -> None:
        if tensor_parallel < 1 or not 0 < compute_efficiency <= 1:
            raise ValueError(
                f"need tensor_parallel >= 1 and 0 < compute_efficiency <= 1, got {tensor_parallel}, "
                f"{compute_efficiency}"
            )
        tp = tensor_parallel
        self.name = f"{gpu.name}-{model.name}" + (f"-tp{tp}" if tp > 1 else "") + ("-paperfit" if fit else "")
        self.gpu = gpu
        self.model = model
        self.block_size = block_size
        self.fit = fit
        self.tensor_parallel = tp
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self._weight_bytes = model.params * model.bytes_per_param
        efficiency = fit.bandwidth_efficiency if fit else 1.0
        # t GPUs: t times the bandwidth and FLOP/s; a sequence's heads spread over them (heads/t CTAs each)
        self._hbm_bytes_per_s = gpu.hbm_bytes_per_s * efficiency * tp
        self._flops = gpu.dense_flops * compute_efficiency * tp
        cta = fit.cta_bytes_per_s if fit else gpu.hbm_bytes_per_s / gpu.sm_count
        # most HBM bandwidth one sequence can draw: its `heads` CTAs together
        self._seq_bytes_per_s = min(model.heads * cta, self._hbm_bytes_per_s)
        # ring all-reduce of one token's activations, twice a layer: 2(t-1)/t of the bytes over NVLink
        self._allreduce_s_per_token = (
            2
            * model.layers
            * 2
            * (tp - 1)
            / tp
            * model.hidden
            * model.bytes_per_param
            / gpu.nvlink_bytes_per_s
        )

    @property
    def decode_capacity_blocks(self) -> int:
        free = self.gpu.hbm_bytes * self.gpu.memory_utilization * self.tensor_parallel - self._weight_bytes
        return max(0, int(free // (self.block_size * self.kv_bytes_per_token)))

    def linear_s(self, batch: int) -> float:
        """Weights and MLP/projections: compute- or weight-read-bound, whichever is slower."""
        compute = 2.0 * self.model.params * batch / self._flops
        return max(compute, self._weight_bytes / self._hbm_bytes_per_s) + self._allreduce_s_per_token * batch

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

    def decode_parts(self, kv_lens: Sequence[int]) -> DecodeParts:
        n = len(kv_lens)
        per_byte = self.kv_bytes_per_token / self._hbm_bytes_per_s
        return DecodeParts(self.linear_s(n) if n else 0.0, sum(kv_lens) * per_byte, n * per_byte)

    def _attention_flops(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Causal attention of prefill chunks: new tokens n attend to the c before them and to each other."""
        per = 2.0 * self.model.layers * self.model.hidden
        return per * sum(n * n + 2 * n * c for c, n in chunks)

    def prefill_s(self, input_lens: Sequence[int]) -> float:
        """Compute-bound: 2·params FLOPs a token plus causal attention 2·layers·hidden·n² a prompt."""
        tokens = sum(input_lens)
        if tokens == 0:
            return 0.0
        flops = 2.0 * self.model.params * tokens + self._attention_flops([(0, n) for n in input_lens])
        return max(flops / self._flops, self._weight_bytes / self._hbm_bytes_per_s) + (
            self._allreduce_s_per_token * tokens
        )

    def step_s(self, kv_lens: Sequence[int], chunks: Sequence[tuple[int, int]]) -> float:
        """Linear part over every token of the pass, the decodes' attention (memory-bound, with the
        bubble) and the chunks' attention (compute-bound), one after another as separate kernels."""
        tokens = len(kv_lens) + sum(n for _, n in chunks)
        if tokens == 0:
            return 0.0
        return self.linear_s(tokens) + self.attention_s(kv_lens) + self._attention_flops(chunks) / self._flops

    def transfer_s(self, blocks: int, link: Link) -> float:
        # with tensor parallelism each GPU holds 1/t of the KV and moves it over its own link
        rate = self.gpu.pcie_bytes_per_s if link is Link.PCIE else self.gpu.nvlink_bytes_per_s
        return blocks * self.block_size * self.kv_bytes_per_token / (rate * self.tensor_parallel)


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


__all__ = [
    "H100_SXM",
    "LLAMA_7B",
    "OPT_13B",
    "AttentionFit",
    "CostModel",
    "DecodeParts",
    "GpuCostModel",
    "GpuSpec",
    "Link",
    "ModelSpec",
    "SpanCost",
    "fit_attention",
]
