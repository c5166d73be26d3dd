"""bfloat16 linear layers through a C kernel for decode on CPUs with AVX-512 BF16 (`cpu_linear.c`), on
AMX tiles where the CPU has them (`cpu_linear_amx.c`: the same packed weight, k a multiple of 32).

At decode's few rows oneDNN's bfloat16 GEMM on such a CPU (without AMX) neither streams the weights at
memory speed nor reaches the core's vdpbf16ps rate: over SmolLM2's projections, one thread, it took 24.7
ms at 1 row, 23.4 at 8 and 28.4 at 13 against the kernel's 14.3, 13.4 and 19.3 (docs/benchmarks.md,
"Decode on the AVX-512 BF16 host"). The kernel streams each packed weight once per call with every
row's accumulators in registers, and prefetches the next columns into L2. Each weight (q/k/v and gate/up
concatenated, as `PackedCpuLinear` does) is packed once per loaded model into the layout the
instruction reads.

On AMX tiles oneDNN's GEMM beat the AVX-512 kernel, but at decode's rows it streams the weights at ~9
GB/s: SmolLM2's projections took 29-30 ms at 2-16 rows, one thread, against the tile kernel's 19-22 ms
(docs/benchmarks.md, "Decode linears on AMX tiles").

The engine uses it for decode forwards where the "cpu" decode backend runs (`engine._decode_linears`),
for MIN_ROWS .. MAX_ROWS rows; other calls go to `small` (the model's own kernel). One row stays there
for the accuracy contract: the kernel sums in another order than oneDNN, so ~0.005 % of its outputs
differ from transformers' by one bfloat16 step.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from alignedserve.engine.cpu_kernels import I64, PTR, KernelUnavailable, available, bound, run_threaded
from alignedserve.engine.linear import FusedGroup, LinearKernel, projection_units

__all__ = ["CpuKernelLinear", "KernelUnavailable", "kernel_available"]

# Rows the kernel takes: one row stays on `small` (the accuracy contract's batch-1 parity); at 128 rows and
# more oneDNN is as fast or faster (a decode step of 2 / 13 / 32 / 64 rows: 1.66 / 1.39 / 1.15 / 1.05x;
# docs/benchmarks.md).
MIN_ROWS, MAX_ROWS = 2, 64
COLUMN_BLOCK = 16  # output columns per packed block (cpu_linear.c)


def kernel_available() -> bool:
    return available(library)


LINEAR_ARGS = [PTR, I64, PTR, PTR, I64, I64, I64, I64, I64]  # x, ldx, packed, out, ldo, rows, k, n, threads
AMX_K = 32  # the tile kernel's k step


@functools.cache
def library() -> ctypes.CDLL:
    return bound("cpu_linear.c", {"pack_weight_bf16": [PTR, PTR, I64, I64], "linear_bf16": LINEAR_ARGS})


@functools.cache
def amx_library() -> ctypes.CDLL | None:
    """The tile kernel, where the CPU has AMX bfloat16 and Linux grants this process tile data; else None."""
    try:
        amx = bound("cpu_linear_amx.c", {"amx_permit": [], "linear_amx_bf16": LINEAR_ARGS})
    except KernelUnavailable:
        return None
    return amx if amx.amx_permit() == 0 else None


def _gemm(in_features: int) -> Callable[..., int]:
    """The tile kernel where it runs and takes k, else the AVX-512 one (both read the same packed weight)."""
    amx = amx_library()
    if amx is not None and in_features % AMX_K == 0:
        return cast(Callable[..., int], amx.linear_amx_bf16)
    return cast(Callable[..., int], library().linear_bf16)


def packable(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return weight.dtype == torch.bfloat16 and out_features % COLUMN_BLOCK == 0 and in_features % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 -> the same elements in the kernel's layout ([out / 16][in / 2][16][2])."""
    weight = weight.detach().contiguous()
    packed = torch.empty_like(weight)
    if library().pack_weight_bf16(weight.data_ptr(), packed.data_ptr(), *weight.shape) != 0:
        raise ValueError(f"the cpu linear kernel cannot pack a weight of {tuple(weight.shape)}")
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x: [T, in] bfloat16 (rows may be strided) @ the packed weight -> [T, out] bfloat16."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    out = torch.empty(rows, packed.shape[0], dtype=x.dtype, device=x.device)
    arguments = (
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows,
        in_features,
        packed.shape[0],
    )
    run_threaded(_gemm(in_features), arguments, f"a linear of {tuple(x.shape)}")
    return out


PackedWeights = dict[tuple[int, ...], torch.Tensor]  # module ids (one, or a group's) -> packed weight
_PACKED: weakref.WeakKeyDictionary[Any, PackedWeights] = weakref.WeakKeyDictionary()


def packed_weights(hf_model: Any, groups: list[FusedGroup]) -> PackedWeights:
    """Every bias-free bfloat16 linear of the model the kernel can take, packed once per loaded model (every
    engine built on it shares them); the projections of a group as one concatenated weight."""
    packed = _PACKED.get(hf_model)
    if packed is None:
        packed = {}
        modules = [m for m in hf_model.modules() if isinstance(m, nn.Linear)]
        with torch.inference_mode():
            for unit in projection_units(modules, groups):
                weight = torch.cat([m.weight for m in unit]) if len(unit) > 1 else unit[0].weight
                if packable(weight) and all(m.bias is None for m in unit):
                    packed[tuple(id(m) for m in unit)] = pack(weight)
        _PACKED[hf_model] = packed
    return packed


class CpuKernelLinear:
    """`linear` at MIN_ROWS .. MAX_ROWS rows for every weight it could pack; everything else through `small`.
    `weights` packs them on the first call that needs them: an engine that never decodes (a prefill
    worker's) never holds the copy."""

    name = "cpu"

    def __init__(self, weights: Callable[[], PackedWeights], small: LinearKernel) -> None:
        self.small = small
        self._weights = weights
        self._packed: PackedWeights | None = None

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        packed = self._weight((module,), x)
        return self.small(module, x) if packed is None else linear(x, packed)

    def many(self, group: FusedGroup, x: torch.Tensor) -> list[torch.Tensor]:
        packed = self._weight(group, x)
        if packed is None:
            return self.small.many(group, x)
        return list(torch.split(linear(x, packed), [m.out_features for m in group], dim=-1))

    def fused(self, group: FusedGroup, x: torch.Tensor) -> torch.Tensor:
        packed = self._weight(group, x)
        return self.small.fused(group, x) if packed is None else linear(x, packed)

    def _weight(self, unit: FusedGroup, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight for this call, or None where `small` takes it."""
        if not MIN_ROWS <= x.shape[0] <= MAX_ROWS or x.dtype != torch.bfloat16:
            return None
        if self._packed is None:
            self._packed = self._weights()
        return self._packed.get(tuple(id(m) for m in unit))
