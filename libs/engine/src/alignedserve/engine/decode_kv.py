"""Where decode attention reads each group's K/V: gathered from the paged blocks every iteration, or
staged in contiguous per-group buffers that persist while the decode batch is stable.

The paged cache stays the source of truth (export, import and eviction read it); a staged buffer is a
copy of one group's K/V laid out as SDPA wants it, [G, kv_heads, capacity, head_dim] per layer. While
the group keeps the same rows, each iteration writes only the new token's K/V into it (next to the
paged write) instead of re-gathering every row's blocks; the buffer is rebuilt (one gather) when the
group's rows change, when its headroom runs out, or after anything else wrote the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from alignedserve.engine.kv_cache import KvLayout, PagedKvCache


@dataclass(frozen=True)
class DecodeGroup:
    """Rows of the decode batch that share one SDPA call.

    rows: [G] int64 row indices into the batch; block_tables: [G, n_blocks] int64 (padded with 0);
    mask: [G, 1, 1, n_blocks * block_size] bool, True where a key is inside that row's context;
    None when every row's context fills the group exactly (no padding); bias: the same as
    `additive_mask` gives it. lens: each row's context."""

    rows: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    context_len: int  # keys per row after trimming the padded gather
    lens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GroupKv:
    """One group's K/V as a `DecodeKv` hands them over.

    key, value: [G, kvh, C, d] with C >= the group's context_len (keys past a row's context are padding,
    finite); mask: [G, 1, 1, C] bool, True where a key is inside its row's context, None when every key
    is; bias: that mask as `additive_mask` gives it (for calls that add it to their scores)."""

    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None


def context_mask(lens: tuple[int, ...], keys: int, device: torch.device) -> torch.Tensor:
    """[len(lens), 1, 1, keys] bool: True where key position < that row's context length."""
    positions = torch.arange(keys, device=device)
    return (positions.unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)).view(
        len(lens), 1, 1, keys
    )


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool key mask as float32 scores to add: 0 where True, -inf where False. Made once an iteration,
    so a call adds it in the pass that scales its scores (one float32 pass instead of three)."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


def gather_blocks(blocks: torch.Tensor, block_tables: torch.Tensor, context_len: int) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] gathered by [G, n] tables -> [G, kvh, context_len, d] (a strided view)."""
    groups, n = block_tables.shape
    gathered = blocks.index_select(0, block_tables.view(-1))  # [G * n, bs, kvh, d]: one copy
    gathered = gathered.view(groups, n * blocks.shape[1], blocks.shape[2], blocks.shape[3])
    return gathered[:, :context_len].transpose(1, 2)


class DecodeKv(Protocol):
    """Supplies each decode group's K/V; `begin` is called once per iteration, before any layer."""

    def begin(self, seq_ids: list[int], plan: list[DecodeGroup]) -> None: ...

    def group_kv(
        self,
        cache: PagedKvCache,
        layer: int,
        index: int,
        group: DecodeGroup,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> GroupKv: ...

    def reset(self) -> None: ...


class GatheredKv:
    """Gathers every group's blocks each layer of each iteration (no state)."""

    def begin(self, seq_ids: list[int], plan: list[DecodeGroup]) -> None:
        pass

    def group_kv(
        self,
        cache: PagedKvCache,
        layer: int,
        index: int,
        group: DecodeGroup,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> GroupKv:
        key = gather_blocks(cache.keys[layer], group.block_tables, group.context_len)  # [G, kvh, L, d]
        value = gather_blocks(cache.values[layer], group.block_tables, group.context_len)
        return GroupKv(key, value, group.mask, group.bias)

    def reset(self) -> None:
        pass


@dataclass
class _StagedGroup:
    """One group's buffers: per layer K and V [G, kvh, capacity, d]; `lens`: contexts they hold."""

    seq_ids: tuple[int, ...]
    lens: tuple[int, ...]
    capacity: int
    nbytes: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class _Step:
    """This iteration's action for one group: append the new token of each row, or rebuild."""

    staged: _StagedGroup
    rebuild: bool
    # [G * kvh] int64: where each row's new token goes per head, as rows of the buffer viewed as
    # [G * kvh * capacity, d]. One index_copy_ per layer: indexing the 4-d buffer with
    # [rows, :, positions] takes PyTorch's general index_put path, ~15x slower at these sizes.
    slots: torch.Tensor
    mask: torch.Tensor  # [G, 1, 1, capacity]: the buffer's keys inside each row's context
    bias: torch.Tensor  # the mask as additive_mask gives it


class StagedKv:
    """Per-group contiguous K/V buffers kept across iterations, within `max_bytes` (groups that do
    not fit are gathered as by `GatheredKv`). seq_ids identify rows across iterations."""

    HEADROOM_TOKENS = 32  # appends before a rebuild: one gather per this many iterations

    def __init__(self, layout: KvLayout, max_bytes: int) -> None:
        self.layout = layout
        self.max_bytes = max_bytes
        self.gathered = GatheredKv()
        self._staged: dict[tuple[int, ...], _StagedGroup] = {}
        self._steps: list[_Step | None] = []

    def reset(self) -> None:
        self._staged = {}
        self._steps = []

    def begin(self, seq_ids: list[int], plan: list[DecodeGroup]) -> None:
        kept: dict[tuple[int, ...], _StagedGroup] = {}
        steps: list[_Step | None] = []
        budget = self.max_bytes
        for group in plan:
            ids = tuple(seq_ids[r] for r in group.rows.tolist())
            old = self._staged.get(ids)
            appendable = (
                old is not None
                and old.lens == tuple(n - 1 for n in group.lens)
                and group.context_len <= old.capacity
            )
            if old is not None and appendable:
                staged, rebuild = old, False
            else:
                capacity = group.context_len + self.HEADROOM_TOKENS
                nbytes = len(ids) * capacity * self.layout.bytes_per_token
                staged, rebuild = _StagedGroup(ids, group.lens, capacity, nbytes), True
            if staged.nbytes > budget:
                steps.append(None)
                continue
            staged.lens = group.lens
            kept[ids] = staged
            mask = context_mask(group.lens, staged.capacity, group.rows.device)
            steps.append(
                _Step(staged, rebuild, self._slots(group, staged.capacity), mask, additive_mask(mask))
            )
            budget -= staged.nbytes
        self._staged, self._steps = kept, steps

    def group_kv(
        self,
        cache: PagedKvCache,
        layer: int,
        index: int,
        group: DecodeGroup,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> GroupKv:
        step = self._steps[index]
        if step is None:
            return self.gathered.group_kv(cache, layer, index, group, new_kv)
        staged = step.staged
        if step.rebuild:  # layers run in order 0..n-1: layer 0 starts the lists afresh
            gathered = self.gathered.group_kv(cache, layer, index, group, new_kv)
            staged.keys[layer:] = [self._buffer(gathered.key, staged.capacity)]
            staged.values[layer:] = [self._buffer(gathered.value, staged.capacity)]
        else:
            if new_kv is None:
                raise ValueError("StagedKv needs the new tokens' K/V (new_kv) to append")
            # Each row's new [kvh, d] K/V goes to its own position: buffer[row, :, position].
            dim = self.layout.head_dim
            new_key = new_kv[0][group.rows].reshape(-1, dim)  # [G * kvh, d]
            new_value = new_kv[1][group.rows].reshape(-1, dim)
            staged.keys[layer].view(-1, dim).index_copy_(0, step.slots, new_key)
            staged.values[layer].view(-1, dim).index_copy_(0, step.slots, new_value)
        # Whole buffers: a slice to the context is not dense per (row, head), and a batched matmul copies it.
        return GroupKv(staged.keys[layer], staged.values[layer], step.mask, step.bias)

    def _slots(self, group: DecodeGroup, capacity: int) -> torch.Tensor:
        """[G * kvh]: flat row of buffer[row, head, lens[row] - 1] for every (row, head), row-major."""
        heads = self.layout.num_kv_heads
        device = group.rows.device
        positions = torch.tensor([n - 1 for n in group.lens], dtype=torch.int64, device=device)  # [G]
        rows = torch.arange(len(group.lens), device=device)
        head = torch.arange(heads, device=device)
        return ((rows[:, None] * heads + head[None, :]) * capacity + positions[:, None]).reshape(-1)

    @staticmethod
    def _buffer(kv: torch.Tensor, capacity: int) -> torch.Tensor:
        """[G, kvh, L, d] -> zero-padded contiguous [G, kvh, capacity, d] (zeros: masked keys stay finite)."""
        groups, heads, length, dim = kv.shape
        buffer = kv.new_zeros(groups, heads, capacity, dim)
        buffer[:, :, :length] = kv
        return buffer
