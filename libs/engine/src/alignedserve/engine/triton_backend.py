"""The Triton paged decode kernel behind the `DecodeBackend` interface, and the engine's backend choice.

`select_backend` resolves `EngineConfig.decode_backend`: "auto" is Triton on CUDA when it imports (the
kernel reads the paged cache in place: no gather and no staged copy in HBM), SDPA over groupings
everywhere else; "triton" on CPU needs Triton's interpreter (TRITON_INTERPRET=1 before the first import
of Triton), which is how it is tested without a GPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from alignedserve.engine.decode_backend import (
    DecodeBackend,
    DecodeStep,
    GroupingSelector,
    ReferenceDecode,
    SdpaDecode,
)
from alignedserve.engine.decode_kv import DecodeKv
from alignedserve.engine.kv_cache import PagedKvCache

# triton_decode.paged_decode: (query, keys, values, block_tables, context_lens, scale, max_context) -> out
PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor
]


class _TritonStep:
    strategy = "triton"

    def __init__(
        self, kernel: PagedDecode, block_tables: torch.Tensor, context_lens: torch.Tensor, max_context: int
    ) -> None:
        self.kernel = kernel
        self.block_tables = block_tables  # [B, max_blocks] int32
        self.context_lens = context_lens  # [B] int32
        self.max_context = max_context

    def __call__(
        self,
        cache: PagedKvCache,
        layer: int,
        query: torch.Tensor,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        return self.kernel(
            query,
            cache.keys[layer],
            cache.values[layer],
            self.block_tables,
            self.context_lens,
            scale,
            self.max_context,
        )


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
        width = max(-(-n // self.block_size) for n in context_lens)
        tables = [table[:width] + [0] * (width - len(table[:width])) for table in block_tables]
        return _TritonStep(
            self.kernel,
            torch.tensor(tables, dtype=torch.int32, device=self.device),
            torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            max(context_lens),
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
    name: str, device: torch.device, block_size: int, selector: GroupingSelector, kv: DecodeKv
) -> DecodeBackend:
    """The engine's decode backend for `EngineConfig.decode_backend` = name."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if name == "triton":
        return TritonDecode(block_size, device)
    if name == "reference":
        return ReferenceDecode(device)
    return SdpaDecode(selector, block_size, device, kv)
