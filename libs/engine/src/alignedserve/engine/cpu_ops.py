"""A Llama-family layer's element-wise steps in bfloat16 through C kernels (`cpu_ops.c`), for decode.

In a decode step of a few rows, the RMSNorms, residual adds, rotary positions and gated SiLU are ~16
torch calls a layer whose time is mostly per-call overhead (docs/benchmarks.md, "Decode on the AVX-512
BF16 host"); here each is one call: the residual add with the next norm, q/k's rotation, SiLU with its
product. They round to bfloat16 where torch does (`model.TorchLayerOps`), so only the RMS's float32 sum
and expf may differ by an ulp. The engine uses them for decode forwards where the "cpu" decode backend
runs (`engine._decode_model`); one-row calls, and shapes the kernels do not take, go through torch's.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from alignedserve.engine.cpu_kernels import I64, PTR, KernelUnavailable, available, bound
from alignedserve.engine.model import TorchLayerOps

__all__ = ["CpuLayerOps", "KernelUnavailable", "kernel_available"]

MIN_ROWS = 2  # one row: torch's calls (the accuracy contract's batch-1 parity)


def kernel_available() -> bool:
    return available(library)


@functools.cache
def library() -> ctypes.CDLL:
    return bound(
        "cpu_ops.c",
        {
            "add_rms_norm_bf16": [PTR, I64, PTR, I64, PTR, PTR, I64, I64, I64, ctypes.c_float],
            "rotary_bf16": [PTR, I64, PTR, PTR, PTR, I64, I64, I64],
            "silu_mul_bf16": [PTR, I64, PTR, I64, PTR, I64, I64],
        },
    )


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"the cpu layer kernels cannot run {what}")


def _rows_ok(x: torch.Tensor) -> bool:
    """bfloat16 rows with unit stride inside, and enough of them to leave torch's path."""
    return x.dtype == torch.bfloat16 and x.shape[0] >= MIN_ROWS and x.stride(-1) == 1


class CpuLayerOps:
    name = "cpu"

    def __init__(self, silu: bool) -> None:
        """silu: the model's MLP activation is SiLU (else its own act_fn runs)."""
        library()  # fail at start (KernelUnavailable), not at the first step
        self.silu = silu
        self.torch = TorchLayerOps()

    def add_rms_norm(
        self, module: Any, h: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, hidden = h.shape
        weight = module.weight
        if not _rows_ok(h) or hidden % 16 or weight.dtype != h.dtype or not weight.is_contiguous():
            return self.torch.add_rms_norm(module, h, delta)
        if delta is not None and delta.stride(-1) != 1:
            return self.torch.add_rms_norm(module, h, delta)
        out = torch.empty_like(h)
        delta_ptr, delta_ld = (None, 0) if delta is None else (delta.data_ptr(), delta.stride(0))
        status = library().add_rms_norm_bf16(
            h.data_ptr(), h.stride(0), delta_ptr, delta_ld, weight.data_ptr(),
            out.data_ptr(), out.stride(0), rows, hidden, module.variance_epsilon,
        )  # fmt: skip
        _check(status, f"an RMSNorm of {hidden}")
        return h, out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens, vectors, dim = x.shape
        if not _rows_ok(x) or x.stride(1) != dim or dim % 32 or cos.dtype != x.dtype:
            return self.torch.rotary(x, cos, sin)
        cos, sin = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
        out = torch.empty(tokens, vectors, dim, dtype=x.dtype, device=x.device)
        status = library().rotary_bf16(
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, vectors, dim
        )
        _check(status, f"rotary positions of d={dim}")
        return out

    def silu_mul(self, act_fn: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        rows, width = gate.shape
        if not (self.silu and _rows_ok(gate) and up.stride(-1) == 1) or width % 16:
            return self.torch.silu_mul(act_fn, gate, up)
        out = torch.empty(rows, width, dtype=gate.dtype, device=gate.device)
        status = library().silu_mul_bf16(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows, width
        )
        _check(status, f"a gated SiLU of {width}")
        return out
