"""Attention over the paged KV cache, for prefill chunks and for variable-length decode batches.

Decode is where batch shape matters: every row has its own context length. A `DecodeGrouping` splits
the rows into groups; each group runs one attention call (`group_call`: SDPA, or on a bfloat16 CPU the
eager formulation) over its rows' KV gathered block-wise (or staged) and padded to the group's longest
context (padding masked out). One group is "padded batched SDPA", one group per row is "per-sequence
calls", groups of similar lengths are "per-length buckets". The plan is made once per iteration and
reused by every layer. All of it is device-agnostic torch (CPU and CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from alignedserve.engine.config import cpu_has_amx_bf16
from alignedserve.engine.decode_kv import (
    DecodeGroup,
    DecodeKv,
    GatheredKv,
    GroupKv,
    additive_mask,
    context_mask,
    gather_blocks,
)
from alignedserve.engine.kv_cache import PagedKvCache

__all__ = ["DecodeGroup", "gather_blocks"]  # re-exported: the decode plan's types live in decode_kv


class DecodeGrouping(Protocol):
    """Splits context lengths into groups of row indices (each group: one SDPA call)."""

    name: str

    def groups(self, context_lens: list[int]) -> list[list[int]]: ...


class PaddedGrouping:
    """One call for the whole batch, padded to the longest context."""

    name = "padded"

    def groups(self, context_lens: list[int]) -> list[list[int]]:
        return [list(range(len(context_lens)))]


class PerSequenceGrouping:
    """One call per row: no padding, most call overhead."""

    name = "per_sequence"

    def groups(self, context_lens: list[int]) -> list[list[int]]:
        return [[row] for row in range(len(context_lens))]


class BucketedGrouping:
    """Rows sorted by length; a new bucket starts when padding a row to the bucket's longest context would
    waste more than `max_pad_tokens` keys (an extra call costs about that much). A bucket whose padded
    keys pass `max_group_keys` (large gathers fall out of cache and cost page faults) is cut into the
    fewest near-equal groups under the cap: which rows share a group then changes only when the number
    of groups does, so staged K/V buffers (`decode_kv.StagedKv`) survive the iterations in between."""

    name = "bucketed"

    def __init__(self, max_pad_tokens: int, max_group_keys: int = 1 << 62) -> None:
        self.max_pad_tokens = max_pad_tokens
        self.max_group_keys = max_group_keys

    def groups(self, context_lens: list[int]) -> list[list[int]]:
        order = sorted(range(len(context_lens)), key=lambda row: -context_lens[row])
        buckets: list[list[int]] = []
        longest = -1
        for row in order:
            length = context_lens[row]
            if not buckets or longest - length > self.max_pad_tokens:
                buckets.append([])
                longest = length
            buckets[-1].append(row)
        return [group for bucket in buckets for group in self._split(bucket, context_lens[bucket[0]])]

    def _split(self, rows: list[int], longest: int) -> list[list[int]]:
        parts = max(1, -(-len(rows) * longest // self.max_group_keys))
        size = -(-len(rows) // parts)
        return [rows[start : start + size] for start in range(0, len(rows), size)]


def plan_decode(
    grouping: DecodeGrouping,
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> list[DecodeGroup]:
    """Per-iteration decode plan: tensors every layer reuses. context_lens include the new token."""
    plan = []
    for rows in grouping.groups(context_lens):
        lens = [context_lens[r] for r in rows]
        longest = max(lens)
        n_blocks = -(-longest // block_size)
        tables = [_padded(block_tables[r], n_blocks) for r in rows]
        mask = context_mask(tuple(lens), longest, device) if min(lens) != longest else None
        plan.append(
            DecodeGroup(
                rows=torch.tensor(rows, dtype=torch.int64, device=device),
                block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
                mask=mask,
                bias=None if mask is None else additive_mask(mask),
                context_len=longest,
                lens=tuple(lens),
                batch_order=rows == list(range(len(context_lens))),
            )
        )
    return plan


def _padded(table: list[int], n_blocks: int) -> list[int]:
    head = table[:n_blocks]
    return head + [0] * (n_blocks - len(head))


def decode_attention(
    cache: PagedKvCache,
    layer: int,
    query: torch.Tensor,
    plan: list[DecodeGroup],
    scale: float,
    kv: DecodeKv | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """query: [B, heads, head_dim] (one new token per row, its K/V already written to `cache`);
    new_kv: that K/V, each [B, kvh, head_dim], for a `kv` that stages it -> [B, heads, head_dim]."""
    source = kv or GatheredKv()
    call = group_call(query)
    if len(plan) == 1 and plan[0].batch_order:
        return call(query, source.group_kv(cache, layer, 0, plan[0], new_kv), plan[0], scale)
    out = torch.empty_like(query)
    for index, group in enumerate(plan):
        kv_of_group = source.group_kv(cache, layer, index, group, new_kv)
        out.index_copy_(0, group.rows, call(query[group.rows], kv_of_group, group, scale))
    return out


# One group's attention. query: [G, heads, d]; its K/V as `DecodeKv.group_kv` hands them -> [G, heads, d].
GroupCall = Callable[[torch.Tensor, GroupKv, DecodeGroup, float], torch.Tensor]


def group_call(query: torch.Tensor) -> GroupCall:
    """How every group of a decode batch attends. query: [B, heads, d], the whole batch.

    CPU float32: SDPA over stacked heads (exact parity with transformers holds). CPU reduced precision:
    transformers' own SDPA call when the batch is one row, where it is the accuracy contract's reference
    bit for bit (a stacked call rounds differently in ~5 % of bfloat16 outputs, which cost greedy
    agreement 84 % vs 100 % at batch 1), and for every group where the CPU has AMX tiles: torch's CPU
    flash kernel computes on them, 1.2-1.5x faster than the other two at 4-64 rows x 256-2,048 keys
    (docs/benchmarks.md, "Decode attention in bfloat16"). Without AMX, for a batch of several rows,
    where batching has already changed the rounding of every matmul, transformers' eager formulation
    over stacked heads for a group of `EAGER_MIN_ROWS` or more, SDPA over stacked heads for a smaller
    one: the flash kernel makes small GEMM calls per row and head (transformers' call ~5x, stacked SDPA
    1.0-1.6x the eager time at 4-64 rows on an AVX-512 BF16 host). CUDA: transformers' call (its fused
    kernels)."""
    if query.device.type != "cpu":
        return _transformers_call
    if query.dtype == torch.float32:
        return _stacked_sdpa_call
    if query.shape[0] == 1 or cpu_has_amx_bf16():
        return _transformers_call
    return _by_group_rows


# From this many rows a group of a reduced-precision CPU batch takes the eager path; below it, SDPA over
# stacked heads (0.22 vs 0.29 ms a layer at one row x 1,000 keys, 0.50 vs 0.56 at two; the eager path
# leads from three rows and 2,000 keys: 0.96 vs 1.14 ms; AVX-512 BF16 host, one thread).
EAGER_MIN_ROWS = 3


def _by_group_rows(query: torch.Tensor, kv: GroupKv, group: DecodeGroup, scale: float) -> torch.Tensor:
    call = _eager_call if query.shape[0] >= EAGER_MIN_ROWS else _stacked_sdpa_call
    return call(query, kv, group, scale)


def _transformers_call(query: torch.Tensor, kv: GroupKv, group: DecodeGroup, scale: float) -> torch.Tensor:
    key, value = kv.key[:, :, : group.context_len], kv.value[:, :, : group.context_len]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), key, value, attn_mask=group.mask, scale=scale, enable_gqa=True
    )  # [G, heads, 1, d]
    return out.squeeze(2)


def _stacked_sdpa_call(query: torch.Tensor, kv: GroupKv, group: DecodeGroup, scale: float) -> torch.Tensor:
    key, value = kv.key[:, :, : group.context_len], kv.value[:, :, : group.context_len]
    return grouped_query_attention(query, key, value, group.mask, scale)


def _eager_call(query: torch.Tensor, kv: GroupKv, group: DecodeGroup, scale: float) -> torch.Tensor:
    # The whole buffers: a [:, :, :L] slice is not dense per (row, head), and a batched matmul copies it.
    return eager_grouped_query_attention(query, kv.key, kv.value, kv.bias, scale)


def eager_grouped_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """As `grouped_query_attention`, in transformers' eager formulation: scores in the K/V dtype, softmax
    in float32, probabilities back in the K/V dtype for the value matmul.

    query: [G, heads, d]; key, value: [G, kvh, L, d], each (row, head) dense (a sliced buffer makes the
    batched matmuls copy it); bias: [G, 1, 1, L] float32 (`additive_mask`: 0 or -inf) or None
    -> [G, heads, d]."""
    groups, kv_heads, _, dim = key.shape
    stacked = query.reshape(groups, kv_heads, query.shape[1] // kv_heads, dim)
    scores = torch.matmul(stacked, key.transpose(-1, -2))  # [G, kvh, heads/kvh, L] in the K/V dtype
    # float32 scaled scores plus the mask, in one pass (the same values as converting, scaling and
    # masking in three: the scale multiplies in float32 either way).
    scaled = scores.float().mul_(scale) if bias is None else torch.add(bias, scores, alpha=scale)
    probs = scaled.softmax(dim=-1).to(value.dtype)
    return torch.matmul(probs, value).reshape(groups, query.shape[1], dim)


def grouped_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One-token attention with the query heads that share a KV head stacked as that head's query rows.

    query: [G, heads, d]; key, value: [G, kvh, L, d]; mask: [G, 1, 1, L] bool or None -> [G, heads, d].
    SDPA then sees plain multi-head attention over kvh heads with heads / kvh queries each (no causal
    mask: they are one position). On this 2-core CPU, 30 layers' K/V cycled (docs/engine.md): 0.91-0.99x
    the time of two batched matmuls + softmax (the previous path) at 4-256 rows and 128-4,096 keys, and
    0.67-0.82x SDPA with `enable_gqa` at one row; the matmul path had beaten `enable_gqa` by 35-40% per
    layer at 64 x 128 and 16 x 2048.
    """
    groups, kv_heads, _, dim = key.shape
    stacked = query.reshape(groups, kv_heads, query.shape[1] // kv_heads, dim)
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scale)
    return out.reshape(groups, query.shape[1], dim)


@dataclass(frozen=True)
class PrefillSpan:
    """One request's chunk inside a flattened prefill batch.

    Query tokens [q_start, q_start + q_len) of the batch are the request's tokens
    [cached, cached + q_len); `block_table`: [n_blocks] int64, used only when cached > 0."""

    q_start: int
    q_len: int
    cached: int
    block_table: torch.Tensor
    _biases: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def causal_bias(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[q_len, cached + q_len] additive mask: 0 where query i (at position cached + i) sees key j
        (j <= cached + i, bottom-right causal), -inf elsewhere. Made once per forward and shared by every
        layer: SDPA would turn a boolean mask into this same tensor at each call."""
        bias = self._biases.get(dtype)
        if bias is None:
            total = self.cached + self.q_len
            positions = torch.arange(self.q_len, device=device).unsqueeze(1) + self.cached
            hidden = torch.arange(total, device=device).unsqueeze(0) > positions  # [q, total]
            bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
            self._biases[dtype] = bias
        return bias


# A paged prefill kernel (`cpu_attention.paged_prefill`): (query [q, heads, d], one layer's keys and values
# [num_blocks, block_size, kvh, d], block_table [n_blocks], cached, scale) -> [q, heads, d]
PagedPrefill = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def prefill_attention(
    cache: PagedKvCache,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: list[PrefillSpan],
    scale: float,
    kernel: PagedPrefill | None = None,
) -> torch.Tensor:
    """query: [T, heads, d]; key, value: [T, kvh, d] (this chunk's, already written) -> [T, heads, d].

    kernel: attends the spans that continue a cached prefix, from the paged cache. A prompt's first
    chunk keeps SDPA, transformers' own call: in bfloat16 the kernel rounds differently, and a whole
    short prompt attended by it cost the accuracy contract's greedy agreement (78 % on its small set,
    against 100 %). A continuation chunk has no such reference (transformers prefills in one call), and
    it is where attention costs most: its queries see the whole prefix."""
    out = torch.empty_like(query)
    for span in spans:
        rows = slice(span.q_start, span.q_start + span.q_len)
        if kernel is not None and span.cached > 0:
            out[rows] = kernel(
                query[rows], cache.keys[layer], cache.values[layer], span.block_table, span.cached, scale
            )
        else:
            out[rows] = _sdpa_span(cache, layer, query[rows], key[rows], value[rows], span, scale)
    return out


def _sdpa_span(
    cache: PagedKvCache,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    """One span by SDPA. query: [q, heads, d]; key, value: [q, kvh, d] (its own) -> [q, heads, d]."""
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
    if span.cached == 0:
        # Whole prompt in this chunk: attend to its own K/V, plain causal.
        k, v = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        total = span.cached + span.q_len
        tables = span.block_table.unsqueeze(0)
        k = gather_blocks(cache.keys[layer], tables, total)  # [1, kvh, total, d]
        v = gather_blocks(cache.values[layer], tables, total)
        mask = span.causal_bias(query.dtype, query.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
