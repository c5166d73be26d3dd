"""Where decode attention reads each group's K/V: gathered from the paged blocks every iteration, or
staged in contiguous per-group buffers that persist while the decode batch is stable.

The paged cache stays the source of truth (export, import and eviction read it); a staged buffer is a
copy of one group's K/V laid out as SDPA wants it, [slots, kv_heads, capacity, head_dim] per layer, its
rows in the first G slots. Each iteration writes only the new token's K/V into it (next to the paged
write) instead of re-gathering every row's blocks. When rows leave or join, the buffer is edited in
place: a kept row from the tail moves into each leaver's slot, and joiners' blocks are gathered into
the free slots after the kept rows (the group's rows are then listed in slot order). It is rebuilt (one
gather of every row) when its key headroom runs out, when more rows join than it has slots, or when a
kept row is not exactly one token past what the buffer holds for it. Rows are identified by a serial
per request (`Request.serial`), so a prefill or KV import of another request leaves the buffers alone.
"""

from __future__ import annotations

import dataclasses
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
    `additive_mask` gives it. lens: each row's context. batch_order: rows are 0..G-1 of the batch in
    order, so a one-group batch attends its query as it is (no gather of rows, no scatter back)."""

    rows: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    context_len: int  # keys per row after trimming the padded gather
    lens: tuple[int, ...]
    batch_order: bool


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

    def begin(self, seq_ids: list[int], plan: list[DecodeGroup]) -> list[DecodeGroup]:
        """-> the plan every layer of this iteration runs: `plan`, a group's rows possibly reordered."""
        ...

    def group_kv(
        self,
        cache: PagedKvCache,
        layer: int,
        index: int,
        group: DecodeGroup,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> GroupKv: ...


class GatheredKv:
    """Gathers every group's blocks each layer of each iteration (no state)."""

    def begin(self, seq_ids: list[int], plan: list[DecodeGroup]) -> list[DecodeGroup]:
        return plan

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


@dataclass
class _StagedGroup:
    """One group's buffers: per layer K and V [slots, kvh, capacity, d], the live rows in the first
    len(seq_ids) slots; `lens`: the contexts those rows hold, in slot order."""

    seq_ids: list[int]
    lens: tuple[int, ...]
    capacity: int
    slots: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def nbytes(self, bytes_per_token: int) -> int:
        return self.slots * self.capacity * bytes_per_token


@dataclass(frozen=True)
class _Edit:
    """Rows that left or joined a staged group since its last iteration, applied layer by layer.

    moves: ([M] from, [M] to) int64 slots: kept rows past the kept count fill the leavers' slots below
    it (None: no move); joined_tables: [J, n_blocks] int64, the joiners' block tables (None: nobody
    joined), their K/V bound for slots first_joined.. and `joined_len` keys."""

    moves: tuple[torch.Tensor, torch.Tensor] | None
    joined_tables: torch.Tensor | None
    joined_len: int
    first_joined: int


@dataclass(frozen=True)
class _Step:
    """This iteration's action for one group: rebuild, or edit (if rows changed) and append."""

    staged: _StagedGroup
    rebuild: bool
    edit: _Edit | None
    # [G * kvh] int64: where each row's new token goes per head, as rows of the buffer viewed as
    # [slots * kvh * capacity, d]. One index_copy_ per layer: indexing the 4-d buffer with
    # [rows, :, positions] takes PyTorch's general index_put path, ~15x slower at these sizes.
    slots: torch.Tensor
    mask: torch.Tensor  # [G, 1, 1, capacity]: the buffer's keys inside each row's context
    bias: torch.Tensor  # the mask as additive_mask gives it


class StagedKv:
    """Per-group contiguous K/V buffers kept across iterations, within `max_bytes` (groups that do
    not fit are gathered as by `GatheredKv`). seq_ids identify rows across iterations."""

    HEADROOM_TOKENS = 32  # appends before a rebuild: one gather per this many iterations
    HEADROOM_ROWS = 4  # slots past a rebuilt group's rows, for rows that join before any leaves

    def __init__(self, layout: KvLayout, max_bytes: int) -> None:
        self.layout = layout
        self.max_bytes = max_bytes
        self.gathered = GatheredKv()
        self._staged: list[_StagedGroup] = []
        self._steps: list[_Step | None] = []

    def begin(self, seq_ids: list[int], plan: list[DecodeGroup]) -> list[DecodeGroup]:
        unclaimed = list(self._staged)
        kept: list[_StagedGroup] = []
        steps: list[_Step | None] = []
        planned: list[DecodeGroup] = []
        budget = self.max_bytes
        for group in plan:
            ids = [seq_ids[r] for r in group.rows.tolist()]
            old = self._claim(unclaimed, ids, group)
            if old is None:
                capacity = group.context_len + self.HEADROOM_TOKENS
                staged = _StagedGroup(ids, group.lens, capacity, len(ids) + self.HEADROOM_ROWS)
                edit, rebuild = None, True
            else:
                slot_ids, group, edit = _reslot(old.seq_ids, ids, group)
                staged, rebuild = _StagedGroup(slot_ids, group.lens, old.capacity, old.slots), False
                staged.keys, staged.values = old.keys, old.values
            nbytes = staged.nbytes(self.layout.bytes_per_token)
            if nbytes > budget:
                steps.append(None)
                planned.append(group)
                continue
            kept.append(staged)
            mask = context_mask(group.lens, staged.capacity, group.rows.device)
            slots = self._slots(group, staged.capacity)
            steps.append(_Step(staged, rebuild, edit, slots, mask, additive_mask(mask)))
            planned.append(group)
            budget -= nbytes
        self._staged, self._steps = kept, steps
        return planned

    def _claim(
        self, unclaimed: list[_StagedGroup], ids: list[int], group: DecodeGroup
    ) -> _StagedGroup | None:
        """The staged group sharing the most rows with `group` that can be edited into it, taken out of
        `unclaimed`: every shared row one token behind, the group's keys within its capacity and at most
        HEADROOM_TOKENS short of it (no more padding than a rebuild leaves), its rows within its slots."""
        best, best_shared = None, 0
        wanted = dict(zip(ids, group.lens, strict=True))
        for old in unclaimed:
            if not (0 <= old.capacity - group.context_len <= self.HEADROOM_TOKENS and len(ids) <= old.slots):
                continue
            shared = [(seq, n) for seq, n in zip(old.seq_ids, old.lens, strict=True) if seq in wanted]
            if len(shared) > best_shared and all(wanted[seq] == n + 1 for seq, n in shared):
                best, best_shared = old, len(shared)
        if best is not None:
            unclaimed.remove(best)
        return best

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
        staged, rows = step.staged, len(group.lens)
        if step.rebuild:  # layers run in order 0..n-1: layer 0 starts the lists afresh
            gathered = self.gathered.group_kv(cache, layer, index, group, new_kv)
            staged.keys[layer:] = [self._buffer(gathered.key, staged.capacity, staged.slots)]
            staged.values[layer:] = [self._buffer(gathered.value, staged.capacity, staged.slots)]
        else:
            if new_kv is None:
                raise ValueError("StagedKv needs the new tokens' K/V (new_kv) to append")
            if step.edit is not None:
                self._apply(step.edit, cache, layer, staged)
            # Each row's new [kvh, d] K/V goes to its own position: buffer[row, :, position].
            dim = self.layout.head_dim
            new_key = new_kv[0][group.rows].reshape(-1, dim)  # [G * kvh, d]
            new_value = new_kv[1][group.rows].reshape(-1, dim)
            staged.keys[layer].view(-1, dim).index_copy_(0, step.slots, new_key)
            staged.values[layer].view(-1, dim).index_copy_(0, step.slots, new_value)
        # The first G slots: dense per (row, head), as a batched matmul wants them (a slice along the
        # keys is not, and would be copied).
        return GroupKv(staged.keys[layer][:rows], staged.values[layer][:rows], step.mask, step.bias)

    @staticmethod
    def _apply(edit: _Edit, cache: PagedKvCache, layer: int, staged: _StagedGroup) -> None:
        """Moves kept rows into leavers' slots, then gathers joiners' K/V (their new token included:
        the paged cache has it) into the slots after the kept rows. Keys past a joiner's context keep
        what the slot held before: finite, and masked."""
        for buffer, blocks in (
            (staged.keys[layer], cache.keys[layer]),
            (staged.values[layer], cache.values[layer]),
        ):
            if edit.moves is not None:
                moved_from, moved_to = edit.moves
                buffer.index_copy_(0, moved_to, buffer.index_select(0, moved_from))
            if edit.joined_tables is not None:
                joined = gather_blocks(blocks, edit.joined_tables, edit.joined_len)
                end = edit.first_joined + joined.shape[0]
                buffer[edit.first_joined : end, :, : edit.joined_len] = joined

    def _slots(self, group: DecodeGroup, capacity: int) -> torch.Tensor:
        """[G * kvh]: flat row of buffer[row, head, lens[row] - 1] for every (row, head), row-major."""
        heads = self.layout.num_kv_heads
        device = group.rows.device
        positions = torch.tensor([n - 1 for n in group.lens], dtype=torch.int64, device=device)  # [G]
        rows = torch.arange(len(group.lens), device=device)
        head = torch.arange(heads, device=device)
        return ((rows[:, None] * heads + head[None, :]) * capacity + positions[:, None]).reshape(-1)

    @staticmethod
    def _buffer(kv: torch.Tensor, capacity: int, slots: int) -> torch.Tensor:
        """[G, kvh, L, d] -> zero-padded contiguous [slots, kvh, capacity, d] (zeros: masked keys and
        unused slots stay finite)."""
        groups, heads, length, dim = kv.shape
        buffer = kv.new_zeros(slots, heads, capacity, dim)
        buffer[:groups, :, :length] = kv
        return buffer


def _reslot(
    old_ids: list[int], ids: list[int], group: DecodeGroup
) -> tuple[list[int], DecodeGroup, _Edit | None]:
    """The rows `ids` (of `group`) in the slots of a staged group that held `old_ids` -> (their ids in
    slot order, `group` with its rows in that order, the edit that brings the buffers to it). Kept rows
    below the kept count stay where they are, those past it fill the leavers' slots, joiners follow."""
    still, held = set(ids), set(old_ids)
    kept = sum(seq in still for seq in old_ids)
    moved_to = [slot for slot in range(kept) if old_ids[slot] not in still]
    moved_from = [slot for slot in range(kept, len(old_ids)) if old_ids[slot] in still]
    slot_ids = list(old_ids[:kept])
    for source, target in zip(moved_from, moved_to, strict=True):
        slot_ids[target] = old_ids[source]
    slot_ids += [seq for seq in ids if seq not in held]
    position = {seq: i for i, seq in enumerate(ids)}
    order = [position[seq] for seq in slot_ids]
    if order != list(range(len(ids))):
        group = _reordered(group, order)
    if not moved_to and kept == len(ids):
        return slot_ids, group, None
    device = group.rows.device
    moves = (
        (
            torch.tensor(moved_from, dtype=torch.int64, device=device),
            torch.tensor(moved_to, dtype=torch.int64, device=device),
        )
        if moved_to
        else None
    )
    joined = group.block_tables[kept:] if kept < len(ids) else None
    return slot_ids, group, _Edit(moves, joined, max(group.lens[kept:], default=0), kept)


def _reordered(group: DecodeGroup, order: list[int]) -> DecodeGroup:
    """`group` with its rows taken in `order` (positions within the group)."""
    index = torch.tensor(order, dtype=torch.int64, device=group.rows.device)
    return dataclasses.replace(
        group,
        rows=group.rows[index],
        block_tables=group.block_tables[index],
        mask=None if group.mask is None else group.mask[index],
        bias=None if group.bias is None else group.bias[index],
        lens=tuple(group.lens[i] for i in order),
        batch_order=False,
    )
