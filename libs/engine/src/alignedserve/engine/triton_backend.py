"""The Triton paged decode kernel behind the `DecodeBackend` interface, and the engine's backend choice.

`select_backend` resolves `EngineConfig.decode_backend`: "auto" is Triton on CUDA when it imports (the
kernel reads the paged cache in place: no gather and no staged copy in HBM); on a CPU running bfloat16
(AVX-512 BF16, with or without AMX tiles), the paged C kernel (`cpu_attention.py`) where it builds; SDPA
over groupings everywhere else. "triton" on CPU needs Triton's interpreter (TRITON_INTERPRET=1 before the
first import of Triton), which is how it is tested without a GPU.
"""

from __future__ import annotations

import importlib.util

import torch

from alignedserve.engine import cpu_attention
from alignedserve.engine.decode_backend import (
    DecodeBackend,
    DecodeStep,
    GroupingSelector,
    PagedDecode,
    PagedKernelStep,
    ReferenceDecode,
    SdpaDecode,
)
from alignedserve.engine.decode_kv import DecodeKv


class TritonDecode:
    """Per iteration: the block tables [B, max_blocks] and lengths [B] as int32 on the device, once;
    every layer launches the kernel on them."""

    name = "triton"

    def __init__(self, block_size: int, device: torch.device) -> None:
        check_triton(device)
        # imported here, not at the top: importing Triton fixes whether it interprets (check_triton)
        from alignedserve.engine.triton_decode import paged_decode

        self.kernel: PagedDecode = paged_decode
        self.block_size = block_size
        self.device = device

    def begin(self, seq_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> DecodeStep:
        return PagedKernelStep.build(
            "triton", self.kernel, context_lens, block_tables, self.block_size, self.device
        )


def triton_usable(device: torch.device) -> bool:
    """Triton imports, and can run on `device`: compiled on CUDA, interpreted on CPU."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from alignedserve.engine import triton_decode

    return triton_decode.INTERPRETED


def check_triton(device: torch.device) -> None:
    if importlib.util.find_spec("triton") is None:
        raise ValueError("decode_backend 'triton' needs the triton package (alignedserve-engine[triton])")
    if device.type == "cpu" and not triton_usable(device):
        raise ValueError(
            "decode_backend 'triton' on CPU runs in Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported (transformers imports it)"
        )


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    selector: GroupingSelector,
    kv: DecodeKv,
) -> DecodeBackend:
    """The engine's decode backend for `EngineConfig.decode_backend` = name."""
    if name == "auto":
        name = _auto(device, dtype)
    if name == "triton":
        return TritonDecode(block_size, device)
    if name == "cpu":
        return cpu_kernel_backend(device, dtype, block_size, selector)
    if name == "reference":
        return ReferenceDecode(device)
    return SdpaDecode(selector, block_size, device, kv)


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda" and triton_usable(device):
        return "triton"
    cpu_bfloat16 = device.type == "cpu" and dtype == torch.bfloat16
    if cpu_bfloat16 and cpu_attention.kernel_available():
        return "cpu"
    return "torch"


def cpu_kernel_backend(
    device: torch.device, dtype: torch.dtype, block_size: int, selector: GroupingSelector
) -> DecodeBackend:
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(f"decode_backend 'cpu' runs bfloat16 on a CPU; this engine is {dtype} on {device}")
    try:
        return cpu_attention.CpuKernelDecode.build(selector, block_size, device)
    except cpu_attention.KernelUnavailable as exc:
        raise ValueError(
            f"decode_backend 'cpu' is unavailable here: {exc}; use decode_backend torch"
        ) from exc
