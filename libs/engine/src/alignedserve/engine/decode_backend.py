"""Decode attention backends: how one iteration's rows attend to their paged K/V.

A `DecodeBackend` is chosen once per engine (`EngineConfig.decode_backend`, `select_backend`);
`begin` is called once per decode iteration with the batch's shape and returns the `DecodeStep` every
layer calls (its K/V already written to the paged cache). Backends:

- `SdpaDecode` ("torch"): the per-batch-shape groupings of `alignedserve.engine.attention` (gather or
  staged K/V, then SDPA). Every device; the CPU default.
- `CpuKernelDecode` ("cpu", `cpu_attention.py`): the paged C kernel of `cpu_attention.c`, reading K/V in
  place (prefill attends through its sibling kernel there too). The default on a bfloat16 CPU with
  AVX-512 BF16 (AMX hosts included), where a C compiler builds it.
- `TritonDecode` ("triton", `triton_backend.py`): the paged Triton kernel of `triton_decode.py`. The CUDA
  default where Triton imports.
- `ReferenceDecode` ("reference"): `paged_decode_reference`, one plain softmax per row read straight
  off the block table. Slow; the ground truth the others are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from alignedserve.engine.attention import DecodeGrouping, decode_attention, plan_decode
from alignedserve.engine.config import DECODE_BACKENDS
from alignedserve.engine.decode_kv import DecodeKv, GatheredKv
from alignedserve.engine.kv_cache import PagedKvCache

__all__ = ["DECODE_BACKENDS"]


class DecodeStep(Protocol):
    """One iteration's attention. query: [B, heads, d]; new_kv: the new tokens' K/V, each [B, kvh, d]
    (already in `cache`) -> [B, heads, d]."""

    strategy: str  # what IterationTiming records

    def __call__(
        self,
        cache: PagedKvCache,
        layer: int,
        query: torch.Tensor,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor: ...


class DecodeBackend(Protocol):
    name: str

    def begin(self, seq_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> DecodeStep:
        """seq_ids identify rows across iterations (one per request the engine ever admits, so a row
        decoding in two consecutive iterations has decode alone writing its K/V between them);
        context_lens include the new token."""
        ...


class GroupingSelector:
    """Chooses the decode grouping for a batch shape (see `alignedserve.engine.attention`)."""

    def select(self, context_lens: list[int]) -> DecodeGrouping:
        raise NotImplementedError


class FixedGrouping(GroupingSelector):
    def __init__(self, grouping: DecodeGrouping) -> None:
        self.grouping = grouping

    def select(self, context_lens: list[int]) -> DecodeGrouping:
        return self.grouping


class _SdpaStep:
    def __init__(self, strategy: str, plan: list[object], kv: DecodeKv) -> None:
        self.strategy = strategy
        self.plan = plan
        self.kv = kv

    def __call__(
        self,
        cache: PagedKvCache,
        layer: int,
        query: torch.Tensor,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        return decode_attention(cache, layer, query, self.plan, scale, self.kv, new_kv)  # type: ignore[arg-type]


class SdpaDecode:
    """Groups of rows, each one SDPA call over gathered (or staged) K/V; the grouping by batch shape."""

    name = "torch"

    def __init__(
        self, selector: GroupingSelector, block_size: int, device: torch.device, kv: DecodeKv | None = None
    ) -> None:
        self.selector = selector
        self.block_size = block_size
        self.device = device
        self.kv: DecodeKv = kv or GatheredKv()

    def begin(self, seq_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> DecodeStep:
        grouping = self.selector.select(context_lens)
        plan = plan_decode(grouping, context_lens, block_tables, self.block_size, self.device)
        return _SdpaStep(grouping.name, list(self.kv.begin(seq_ids, plan)), self.kv)


# A paged decode kernel (Triton's or the CPU one): (query [B, heads, d], one layer's keys and values
# [num_blocks, block_size, kvh, d], block_tables [B, max_blocks] int32, context_lens [B] int32, scale,
# max_context) -> [B, heads, d]
PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor
]


class PagedKernelStep:
    """One iteration of a paged kernel: the block tables and lengths made once, every layer calls it."""

    def __init__(
        self,
        strategy: str,
        kernel: PagedDecode,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context: int,
    ) -> None:
        self.strategy = strategy
        self.kernel = kernel
        self.block_tables = block_tables  # [B, max_blocks] int32
        self.context_lens = context_lens  # [B] int32
        self.max_context = max_context

    @classmethod
    def build(
        cls,
        strategy: str,
        kernel: PagedDecode,
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> PagedKernelStep:
        """Tables cut or zero-padded to the longest row's blocks, as int32 on `device`."""
        width = max(-(-n // block_size) for n in context_lens)
        tables = [table[:width] + [0] * (width - len(table[:width])) for table in block_tables]
        return cls(
            strategy,
            kernel,
            torch.tensor(tables, dtype=torch.int32, device=device),
            torch.tensor(context_lens, dtype=torch.int32, device=device),
            max(context_lens),
        )

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


class _ReferenceStep:
    strategy = "reference"

    def __init__(self, context_lens: list[int], block_tables: list[torch.Tensor]) -> None:
        self.context_lens = context_lens
        self.block_tables = block_tables  # one [blocks] int64 per row, built once for every layer

    def __call__(
        self,
        cache: PagedKvCache,
        layer: int,
        query: torch.Tensor,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        return paged_decode_reference(
            query, cache.keys[layer], cache.values[layer], self.block_tables, self.context_lens, scale
        )


class ReferenceDecode:
    """`paged_decode_reference` behind the backend interface (tests and debugging)."""

    name = "reference"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin(self, seq_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> DecodeStep:
        tables = [torch.tensor(t, dtype=torch.int64, device=self.device) for t in block_tables]
        return _ReferenceStep(context_lens, tables)


def paged_decode_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: list[torch.Tensor],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """The definition, row by row in float32. query: [B, heads, d]; keys, values: [num_blocks, bs, kvh,
    d]; block_tables[i]: [>= ceil(len_i / bs)] int64 -> [B, heads, d] in the query's dtype. Query head
    j reads KV head j // (heads / kvh), as SDPA's enable_gqa and transformers' repeat_kv."""
    _, block_size, kv_heads, dim = keys.shape
    group = query.shape[1] // kv_heads
    out = torch.empty_like(query)
    for row, length in enumerate(context_lens):
        blocks = block_tables[row][: -(-length // block_size)]
        k = keys[blocks].reshape(-1, kv_heads, dim)[:length].float()  # [L, kvh, d]
        v = values[blocks].reshape(-1, kv_heads, dim)[:length].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, heads, d]
        scores = torch.einsum("hd,lhd->hl", query[row].float(), k) * scale
        out[row] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(query.dtype)
    return out
