"""Paged attention kernels for CPUs with AVX-512 BF16 (`cpu_attention.c`), and the decode backend around them.

torch has no paged attention on CPU. For decode, the "torch" backend gathers (or stages) each group's
K/V and runs a chain of small ops per group and layer, ~40 % of a bfloat16 decode step on this project's
2-core host; for prefill, torch's CPU flash kernel runs at a sixth of the host's bfloat16 matmul rate
and takes most of a long prompt's forward (docs/benchmarks.md, "Paged attention kernels for CPUs").
`paged_decode` reads K/V in place through the block tables, every row at its own length, in one call
per layer: the CPU counterpart of the Triton kernel CUDA runs (`triton_decode.py`), with the same
signature. `paged_prefill` attends one request's chunk to its cached prefix and itself. The "cpu"
backend (`CpuKernelDecode`) runs both: batches of one decode row keep the "torch" path, whose SDPA call
is the accuracy contract's batch-1 reference bit for bit.

The C source is built and loaded by `cpu_kernels` (once per host, with the system C compiler). The kernels
split their work items (decode: row x KV head; prefill: KV head) across torch's intra-op threads themselves
(`cpu_parallel.h`). No compiler, or a CPU without AVX-512 BF16: `kernel_available()` is False and "auto"
stays on "torch".
"""

from __future__ import annotations

import ctypes
import functools

import torch

from alignedserve.engine.cpu_kernels import I64, PTR, KernelUnavailable, available, bound, run_threaded
from alignedserve.engine.decode_backend import (
    DecodeBackend,
    DecodeStep,
    GroupingSelector,
    PagedKernelStep,
    SdpaDecode,
)
from alignedserve.engine.decode_kv import GatheredKv

__all__ = ["CpuKernelDecode", "KernelUnavailable", "kernel_available", "paged_decode", "paged_prefill"]

MIN_ROWS = 2  # one row: the "torch" path (the accuracy contract's batch-1 parity)


def kernel_available() -> bool:
    return available(library)


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernels, built on first use; KernelUnavailable says why not."""
    decode = [PTR] * 6 + [I64] * 6 + [ctypes.c_float, I64, I64]  # ..., scale, rows, threads
    prefill = [PTR] * 5 + [I64] * 6 + [ctypes.c_float, I64]  # ..., scale, threads
    return bound("cpu_attention.c", {"paged_decode_bf16": decode, "paged_prefill_bf16": prefill})


def paged_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int,
) -> torch.Tensor:
    """query: [B, heads, d] bfloat16; keys, values: [num_blocks, block_size, kvh, d] (one layer's paged
    cache); block_tables: [B, max_blocks] int32; context_lens: [B] int32 -> [B, heads, d]."""
    query = query.contiguous()
    out = torch.empty_like(query)
    rows, heads, dim = query.shape
    _, block_size, kv_heads, _ = keys.shape
    arguments = (
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), heads, kv_heads, dim, block_size, block_tables.shape[1], max_context, scale, rows,
    )  # fmt: skip
    run_threaded(
        library().paged_decode_bf16,
        arguments,
        f"decode with {heads}/{kv_heads} heads, d={dim} (use decode_backend torch)",
    )
    return out


def paged_prefill(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    cached: int,
    scale: float,
) -> torch.Tensor:
    """One request's chunk. query: [q, heads, d] bfloat16, positions cached .. cached + q - 1; keys,
    values: [num_blocks, block_size, kvh, d] (one layer's paged cache, holding all cached + q tokens);
    block_table: [>= blocks of cached + q] int64, contiguous (the span's own, as the runner makes it once a
    forward) -> [q, heads, d], query i seeing keys 0 .. cached + i."""
    query = query.contiguous()
    out = torch.empty_like(query)
    q_len, heads, dim = query.shape
    _, block_size, kv_heads, _ = keys.shape
    arguments = (
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), block_table.data_ptr(), out.data_ptr(),
        q_len, cached, heads, kv_heads, dim, block_size, scale,
    )  # fmt: skip
    run_threaded(
        library().paged_prefill_bf16,
        arguments,
        f"prefill with {heads}/{kv_heads} heads, d={dim} (use decode_backend torch)",
    )
    return out


class CpuKernelDecode:
    """`paged_decode` for batches of MIN_ROWS rows or more; smaller ones through SDPA over gathered K/V
    (no staged copies: the kernel's iterations would leave them stale). Where it runs, the engine's
    prefill attends through `paged_prefill` (`engine.LLMEngine`)."""

    name = "cpu"

    def __init__(self, small: SdpaDecode, block_size: int, device: torch.device) -> None:
        library()  # fail at start (KernelUnavailable), not at the first batch
        self.small: DecodeBackend = small
        self.block_size = block_size
        self.device = device

    @classmethod
    def build(cls, selector: GroupingSelector, block_size: int, device: torch.device) -> CpuKernelDecode:
        return cls(SdpaDecode(selector, block_size, device, GatheredKv()), block_size, device)

    def begin(self, seq_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> DecodeStep:
        if len(context_lens) < MIN_ROWS:
            return self.small.begin(seq_ids, context_lens, block_tables)
        return PagedKernelStep.build(
            "cpu", paged_decode, context_lens, block_tables, self.block_size, self.device
        )
