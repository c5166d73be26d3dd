"""This machine's matmul and memory rooflines at a model's own shapes, and what one decode step costs.

A decode iteration at batch B multiplies a [B, in] activation by every linear weight [out, in] (the LM
head included). Timing `F.linear` at exactly those shapes gives the best time the linear part of an
iteration can take here; its FLOPs over that time is the roofline the engine's big-batch throughput is
compared with (the engine also does attention, norms and sampling, so it stays below it). A step
also reads every weight once and each row's K/V: over the machine's read bandwidth (the best time to sum
a tensor far larger than the caches) that is the memory roofline.

The matmul roofline times each shape alone and repeated, so its weight is in cache. A decode step reads
every layer's own weights, from memory (SmolLM2: 270 MB in bfloat16, past any cache), and at small
batches a GEMM then waits on memory as well as computing: `measure_streamed_linears` times one pass over
as many distinct weights as the model has, the linear part of a step as the engine meets it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from alignedserve.engine.linear import PACKING_HINT_ROWS, packed_available


@dataclass(frozen=True)
class LinearShapes:
    """Every linear weight of a model as (out, in) -> how many times it appears."""

    counts: dict[tuple[int, int], int]
    attention_flops_per_key: int  # FLOPs per token per attended key: 4 * layers * heads * head_dim
    kv_elements_per_key: int  # K and V elements one attended key holds: 2 * layers * kv_heads * head_dim

    @property
    def linear_flops_per_token(self) -> int:
        return sum(2 * out * inp * n for (out, inp), n in self.counts.items())

    def flops_per_token(self, context: int) -> int:
        """2 x linear parameters + attention (QK^T and PV) over `context` keys."""
        return self.linear_flops_per_token + self.attention_flops_per_key * context

    def bytes_per_step(self, batch: int, context: int, element_bytes: int) -> int:
        """Every linear weight read once, and each row's K/V over `context` keys."""
        weights = sum(out * inp * n for (out, inp), n in self.counts.items())
        return (weights + batch * context * self.kv_elements_per_key) * element_bytes


@dataclass(frozen=True)
class Roofline:
    """batch, dtype; linear_s: best time of one iteration's linear part; gflops: its FLOP rate;
    peak_gflops: the fastest single shape."""

    batch: int
    dtype: str
    linear_s: float
    gflops: float
    peak_gflops: float

    @property
    def linear_bound_tok_s(self) -> float:
        return self.batch / self.linear_s


def linear_shapes(model: nn.Module) -> LinearShapes:
    """Read the shapes off the loaded transformers model (tied LM head counted once, as it runs once)."""
    counts: Counter[tuple[int, int]] = Counter()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            counts[(module.out_features, module.in_features)] += 1
    config: Any = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    return LinearShapes(dict(counts), 4 * layers * heads * head_dim, 2 * layers * kv_heads * head_dim)


def measure_roofline(shapes: LinearShapes, batch: int, dtype: torch.dtype, repeats: int = 9) -> Roofline:
    """Best time at each shape (random data), summed with multiplicity, of the fastest kernel this
    machine has for it: F.linear, or oneDNN on a packed weight where available (float32 CPU; what the
    engine uses). Best, not median: a roofline is what the machine can do, and on a shared machine the
    median measures the neighbours."""
    total_s = 0.0
    peak = 0.0
    packed = packed_available(dtype, torch.device("cpu"))
    for (out, inp), count in shapes.counts.items():
        x = torch.randn(batch, inp, dtype=dtype)
        w = torch.randn(out, inp, dtype=dtype)
        seconds = _best_seconds(F.linear, (x, w), repeats)
        if packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(w, PACKING_HINT_ROWS)
            seconds = min(seconds, _best_seconds(_packed_linear, (x, weight), repeats))
        total_s += seconds * count
        peak = max(peak, 2 * batch * out * inp / seconds / 1e9)
    flops = shapes.linear_flops_per_token * batch
    return Roofline(batch, str(dtype).removeprefix("torch."), total_s, flops / total_s / 1e9, peak)


def measure_streamed_linears(
    shapes: LinearShapes, batches: list[int], dtype: torch.dtype, repeats: int = 5
) -> dict[int, float]:
    """batch -> best seconds of one pass through a distinct weight per linear of the model (as many as it
    has, in its order of shapes), with the kernel the engine uses (oneDNN-packed where available)."""
    packed = packed_available(dtype, torch.device("cpu"))
    weights: list[tuple[int, torch.Tensor]] = []  # (in features, weight as the kernel takes it)
    for (out, inp), count in shapes.counts.items():
        for _ in range(count):
            w = torch.randn(out, inp, dtype=dtype)
            weights.append(
                (inp, torch.ops.mkldnn._reorder_linear_weight(w, PACKING_HINT_ROWS) if packed else w)
            )
    kernel = _packed_linear if packed else F.linear
    seconds = {}
    for batch in batches:
        xs = {inp: torch.randn(batch, inp, dtype=dtype) for inp, _ in weights}

        def one_pass(xs: dict[int, torch.Tensor] = xs) -> None:
            for inp, w in weights:
                kernel(xs[inp], w)

        seconds[batch] = _best_seconds(one_pass, (), repeats)
    return seconds


def measure_read_bandwidth(megabytes: int = 512, repeats: int = 9) -> float:
    """GB/s of reading a float32 tensor of `megabytes` (far past any cache), best of `repeats` sums."""
    x = torch.ones(megabytes * 2**20 // 4)
    return x.numel() * 4 / _best_seconds(torch.sum, (x,), repeats) / 1e9


def _packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return out


def _best_seconds(op: Callable[..., object], args: tuple[torch.Tensor, ...], repeats: int) -> float:
    op(*args)  # warm up: first call allocates and picks kernels
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        op(*args)
        samples.append(time.perf_counter() - start)
    return min(samples)
