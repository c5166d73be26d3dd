"""How the lean forward multiplies by a linear layer's weight: a strategy chosen once per engine.

- `TorchLinear`: the module itself (`F.linear`). Used on CUDA, for bfloat16 on a CPU without native
  bfloat16, and wherever oneDNN is missing. (One GEMM over q/k/v's concatenated weight instead of three
  was no faster here: 0.97-1.04x of three `F.linear` calls at 1-64 rows in float32, interleaved.)
- `PackedCpuLinear`: float32 on CPU, and bfloat16 where the CPU computes it natively. Every weight is
  also kept in oneDNN's blocked ("packed") layout, made once at load, and every forward calls oneDNN's
  linear on it. `F.linear` repacks the weight inside every call, a large share of the work at decode's
  row counts. Measured on this 2-core CPU over all of SmolLM2's linears, interleaved in one process
  (docs/engine.md): 1.4-1.9x faster at 1-128 rows, 1.36-1.46x at 192-256, 1.2x at 1024-2048 (prefill
  chunks). float32 results agree with `F.linear` to ~1e-6 relative (a different summation order);
  bfloat16 ones (AMX host) equal it bit for bit (every SmolLM2 projection shape, 1-69 and up to 1,000
  rows), so the accuracy contract's batch-1 parity with transformers holds, at 1.6-3.5x the speed at
  1-16 rows (docs/benchmarks.md, Engine). Projections that read the same input (q/k/v; gate/up) are
  packed as one concatenated weight and run as one call (`many`): one pass over the input, and fewer,
  larger GEMMs.

The packed copies cost the weights' size again in host memory; they are made once per loaded model and
shared by every engine built on it.

- `RowTunedLinear` ("auto" where packing is available): packed from a row count up, the torch module
  below. On another host the packed weights were slower at one row (16.1 vs 21.9 tok/s at batch 1) and
  faster from 4, so the crossover is measured per host and dtype (`linear_crossover.py`).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from alignedserve.engine.config import LINEAR_KERNELS, native_cpu_bfloat16
from alignedserve.engine.linear_crossover import Probe, host_key, min_packed_rows

# Row count the packed layout is tuned for (oneDNN picks its blocking from it); decode batches here.
# Any row count works with it; 64 was as fast as or faster than 1, 256 or 1024 over decode's shapes.
PACKING_HINT_ROWS = 64


FusedGroup = tuple[nn.Linear, ...]  # projections of one input, in output order


def projection_units(modules: list[nn.Linear], groups: list[FusedGroup]) -> list[FusedGroup]:
    """What a kernel multiplies by: every module outside the groups on its own, then every group as one."""
    grouped = {id(m) for group in groups for m in group}
    return [(m,) for m in modules if id(m) not in grouped] + list(groups)


class LinearKernel(Protocol):
    name: str

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] (bias included)."""
        ...

    def many(self, group: FusedGroup, x: torch.Tensor) -> list[torch.Tensor]:
        """Every projection of `group` applied to the same x: [T, in] -> [[T, out_i], ...] (may be views
        of one [T, sum(out_i)] result)."""
        ...

    def fused(self, group: FusedGroup, x: torch.Tensor) -> torch.Tensor:
        """The same side by side: [T, in] -> [T, sum(out_i)], in group order."""
        ...


class TorchLinear:
    name = "torch"

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = module(x)
        return out

    def many(self, group: FusedGroup, x: torch.Tensor) -> list[torch.Tensor]:
        return [module(x) for module in group]

    def fused(self, group: FusedGroup, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.many(group, x), dim=-1)


class PackedCpuLinear:
    name = "onednn_packed"

    def __init__(self, modules: list[nn.Linear], groups: list[FusedGroup]) -> None:
        self._packed: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        with torch.inference_mode():
            for unit in projection_units(modules, groups):
                self._packed[tuple(id(m) for m in unit)] = _pack(unit)

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get((id(module),))
        if entry is None:  # a module the model did not have at load
            out: torch.Tensor = module(x)
            return out
        return _packed_linear(x, entry)

    def many(self, group: FusedGroup, x: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(self.fused(group, x), [m.out_features for m in group], dim=-1))

    def fused(self, group: FusedGroup, x: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(tuple(id(m) for m in group))
        if entry is None:  # a group the model did not name at load
            return torch.cat([module(x) for module in group], dim=-1)
        return _packed_linear(x, entry)


def _pack(group: FusedGroup) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One packed weight for the group's concatenated outputs (and the concatenated bias, if any)."""
    weight = torch.cat([m.weight.detach() for m in group]) if len(group) > 1 else group[0].weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_HINT_ROWS)
    if all(m.bias is None for m in group):
        return packed, None
    biases = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in group]
    return packed, torch.cat(biases)


def _packed_linear(x: torch.Tensor, entry: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    packed, bias = entry
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class RowTunedLinear:
    """ "auto" on CPU float32: the packed weights from `min_rows` rows up, the torch module below —
    which one is faster at few rows depends on the CPU (`linear_crossover.py`)."""

    name = "auto"

    def __init__(self, packed: PackedCpuLinear, min_rows: int) -> None:
        self.packed = packed
        self.min_rows = min_rows
        self._torch = TorchLinear()

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return (self.packed if x.shape[0] >= self.min_rows else self._torch)(module, x)

    def many(self, group: FusedGroup, x: torch.Tensor) -> list[torch.Tensor]:
        return (self.packed if x.shape[0] >= self.min_rows else self._torch).many(group, x)

    def fused(self, group: FusedGroup, x: torch.Tensor) -> torch.Tensor:
        return (self.packed if x.shape[0] >= self.min_rows else self._torch).fused(group, x)


_PACKED: weakref.WeakKeyDictionary[Any, PackedCpuLinear] = weakref.WeakKeyDictionary()


def packed_available(dtype: torch.dtype, device: torch.device) -> bool:
    """float32 on any CPU with oneDNN; bfloat16 only where the CPU computes it natively (elsewhere
    oneDNN's bfloat16 path is emulated, and `auto` runs float32 there anyway)."""
    onednn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    if device.type != "cpu" or not onednn:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_cpu_bfloat16())


def linear_kernel(hf_model: Any, name: str = "auto", groups: list[FusedGroup] | None = None) -> LinearKernel:
    """The kernel for a loaded transformers model; "auto": where packing is available, packed from the
    host's measured row-count crossover up and torch below it (`RowTunedLinear`), else torch.
    `groups`: projections of a shared input to pack as one (the model family names them)."""
    if name not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel must be one of {LINEAR_KERNELS}, got {name!r}")
    weight = hf_model.lm_head.weight
    available = packed_available(weight.dtype, weight.device)
    if name == "torch" or (name == "auto" and not available):
        return TorchLinear()
    if not available:
        raise ValueError(
            "onednn_packed needs float32 weights (or bfloat16 on a CPU with amx_bf16 or avx512_bf16) on a"
            " CPU with oneDNN (mkldnn) in torch; use --linear torch or auto"
        )
    modules = [m for m in hf_model.modules() if isinstance(m, nn.Linear)]
    kernel = _PACKED.get(hf_model)
    if kernel is None:
        kernel = PackedCpuLinear(modules, groups or [])
        _PACKED[hf_model] = kernel
    if name == "onednn_packed":
        return kernel
    return RowTunedLinear(kernel, _min_packed_rows(kernel, modules, groups or [], weight.dtype))


def _min_packed_rows(
    packed: PackedCpuLinear, modules: list[nn.Linear], groups: list[FusedGroup], dtype: torch.dtype
) -> int:
    """The host's crossover for this model's projections (all of them, as one decode step runs them)."""
    units = projection_units(modules, groups)
    shapes = [(sum(m.out_features for m in u), u[0].in_features) for u in units]
    by_shape: dict[tuple[int, int], list[FusedGroup]] = {}
    for shape, unit in zip(shapes, units, strict=True):
        by_shape.setdefault(shape, []).append(unit)
    torch_kernel = TorchLinear()
    probes: list[Probe] = [  # one per distinct shape (every layer has the same ones), weighted by count
        (partial(torch_kernel.many, same[0]), partial(packed.many, same[0]), shape[1], len(same))
        for shape, same in by_shape.items()
    ]
    return min_packed_rows(host_key(shapes, dtype), probes, dtype)
