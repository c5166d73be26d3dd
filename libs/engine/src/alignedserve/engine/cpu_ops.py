"""A Llama-family layer's element-wise steps in bfloat16 through C kernels (`cpu_ops.c`).

In a decode step of a few rows, the RMSNorms, residual adds, rotary positions and gated SiLU are ~16
torch calls a layer whose time is mostly per-call overhead (docs/benchmarks.md, "Decode on the AVX-512
BF16 host"); here each is one call: the residual add with the next norm, q/k's rotation, SiLU with its
product. They round to bfloat16 where torch does (`model.TorchLayerOps`) and the RMS adds its squares in
ATen's order, so all but the SiLU (whose expf may differ by an ulp) are torch's bit for bit. Each splits
its rows across torch's intra-op threads (`cpu_kernels.run_threaded`).
`CpuLayerOps` runs all four, for decode forwards where the "cpu" decode backend runs
(`engine._decode_model`); `ExactCpuLayerOps` only the bit-exact ones, for prefill (`engine._prefill_model`),
after checking them against torch on the model's shapes. One-row calls, and shapes the kernels do not
take, go through torch's.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from alignedserve.engine.cpu_kernels import I64, PTR, KernelUnavailable, available, bound, run_threaded
from alignedserve.engine.model import TorchLayerOps, signed_sin

__all__ = ["CpuLayerOps", "ExactCpuLayerOps", "KernelUnavailable", "first_mismatch", "kernel_available"]

MIN_ROWS = 2  # one row: torch's calls (the accuracy contract's batch-1 parity)
SUM_LANES = (8, 16)  # vector widths whose order of additions cpu_ops.c can follow (AVX2, AVX512)


def kernel_available() -> bool:
    return available(library)


@functools.cache
def library() -> ctypes.CDLL:
    return bound(
        "cpu_ops.c",
        {
            "add_rms_norm_bf16": [PTR, I64, PTR, I64, PTR, PTR, I64, I64, I64, ctypes.c_float, I64, I64],
            "aten_sum_rows": [PTR, I64, I64, I64, PTR],
            "rotary_bf16": [PTR, I64, PTR, PTR, PTR, I64, I64, I64, I64],
            "silu_mul_bf16": [PTR, I64, PTR, I64, PTR, I64, I64, I64],
        },
    )


@functools.cache
def aten_sum_lanes() -> int | None:
    """The vector width whose order of additions torch's float32 row sums (the RMS's mean) follow here, or
    None if neither does. Found by comparing, not from the CPU capability: a wheel builds some kernels,
    the sum among them, only for AVX2, and runs that build on AVX-512 CPUs too. Random rows of 576 and of
    4,096 floats (the latter reaching the sum's cascade) tell the orders apart in ~half of all rows."""
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, n, generator=generator) * 3 for n in (576, 4096)]
    for lanes in SUM_LANES:
        if all(torch.equal(_c_row_sums(x, lanes), x.sum(-1)) for x in rows):
            return lanes
    return None


def _c_row_sums(x: torch.Tensor, lanes: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.float32)
    _check(library().aten_sum_rows(x.data_ptr(), x.shape[0], x.shape[1], lanes, out.data_ptr()), "row sums")
    return out


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
        self.lanes = aten_sum_lanes() or SUM_LANES[0]  # another order: an ulp off at worst

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
        arguments = (
            h.data_ptr(), h.stride(0), delta_ptr, delta_ld, weight.data_ptr(),
            out.data_ptr(), out.stride(0), rows, hidden, module.variance_epsilon, self.lanes,
        )  # fmt: skip
        run_threaded(library().add_rms_norm_bf16, arguments, f"an RMSNorm of {hidden}")
        return h, out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens, vectors, dim = x.shape
        if not _rows_ok(x) or x.stride(1) != dim or dim % 32 or cos.dtype != x.dtype:
            return self.torch.rotary(x, cos, sin)
        cos, sin = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
        out = torch.empty(tokens, vectors, dim, dtype=x.dtype, device=x.device)
        arguments = (
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, vectors, dim,
        )  # fmt: skip
        run_threaded(library().rotary_bf16, arguments, f"rotary positions of d={dim}")
        return out

    def silu_mul(self, act_fn: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        rows, width = gate.shape
        if not (self.silu and _rows_ok(gate) and up.stride(-1) == 1) or width % 16:
            return self.torch.silu_mul(act_fn, gate, up)
        out = torch.empty(rows, width, dtype=gate.dtype, device=gate.device)
        arguments = (
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows, width,
        )  # fmt: skip
        run_threaded(library().silu_mul_bf16, arguments, f"a gated SiLU of {width}")
        return out


class ExactCpuLayerOps:
    """The steps whose C kernels are torch's bit for bit — the residual add with the next RMSNorm, and the
    rotary positions — in C; the gated SiLU through torch. For prefill, which the accuracy contract holds
    to transformers' output: construction checks the kernels against torch on the model's shapes and
    raises KernelUnavailable where they differ (e.g. a torch build whose sum adds in another order)."""

    name = "cpu-exact"

    def __init__(self, hidden: int, head_dim: int) -> None:
        if aten_sum_lanes() is None:
            raise KernelUnavailable("torch's row sums here add in an order the C RMSNorm does not follow")
        self.kernels = CpuLayerOps(silu=False)
        self.torch = TorchLayerOps()
        mismatch = first_mismatch(self.kernels, hidden, head_dim)
        if mismatch:
            raise KernelUnavailable(f"the C {mismatch} differs from torch's here")

    def add_rms_norm(
        self, module: Any, h: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_rms_norm(module, h, delta)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.kernels.rotary(x, cos, sin)

    def silu_mul(self, act_fn: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.torch.silu_mul(act_fn, gate, up)


class _Norm:  # the attributes of transformers' RMSNorm that the steps read
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.variance_epsilon = weight, eps


def first_mismatch(kernels: CpuLayerOps, hidden: int, head_dim: int, seed: int = 0) -> str | None:
    """The first step ("RMSNorm", "rotary") whose C result differs from torch's on random bfloat16 rows of
    these shapes, or None: both computed bit for bit alike."""
    generator = torch.Generator().manual_seed(seed)
    torch_ops = TorchLayerOps()

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).bfloat16()

    norm = _Norm(1 + randn(hidden, scale=0.1), 1e-5)
    for rows in (2, 17, 64):
        h, delta = randn(rows, hidden, scale=3.0), randn(rows, hidden)
        for d in (None, delta):
            got, want = kernels.add_rms_norm(norm, h.clone(), d), torch_ops.add_rms_norm(norm, h.clone(), d)
            if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                return "RMSNorm"
        x = randn(rows, 4, head_dim)
        angles = torch.randn(rows, 1, head_dim, generator=generator)
        cos, sin = angles.cos().bfloat16(), signed_sin(angles.sin().bfloat16())
        if not torch.equal(kernels.rotary(x, cos, sin), torch_ops.rotary(x, cos, sin)):
            return "rotary"
    return None
