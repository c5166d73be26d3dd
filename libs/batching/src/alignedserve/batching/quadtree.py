"""Quad-tree of waiting requests over prefix length [0, max_len) (DESIGN.md §3).

Layout: an implicit complete 4-ary tree in flat lists, heap-numbered (root 0, children of i are
4i+1 .. 4i+4). Every node keeps the `(requests, blocks)` of its subtree and the oldest arrival in it.
Leaves are `leaf_width` tokens wide (one KV block by default) and hold their requests in arrival
order (see `_Leaf`), so a leaf's oldest is O(1) to read in the normal case. Only non-empty leaves have a
container; the counter lists are O(number of leaves), independent of the number of requests.

Costs: insert/remove/move walk one root-to-leaf path, O(depth) = O(log4(max_len / leaf_width)).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import replace
from itertools import chain
from operator import attrgetter

from alignedserve.batching.types import WaitingRequest

INF = float("inf")
DEFAULT_MAX_LEN = 131_072  # 128K-token contexts
DEFAULT_LEAF_WIDTH = 16  # one KV block of the default block size
_ARRIVAL = attrgetter("arrival")


class _Leaf:
    """The requests of one leaf, in arrival order at O(1) per update in the normal case.

    Requests normally enter the pool in arrival order, so `main`, a dict, holds them in insertion
    order = arrival order and the oldest is its first value: no heap, no extra object per request.
    A request arriving out of order (e.g. moved here with its old arrival time) goes to `late`, with
    a lazily pruned heap for its oldest; ordered reads merge the two, and fold `late` into `main`
    (one sort) once it grows past a quarter of `main`.
    """

    __slots__ = ("late", "late_heap", "main", "newest")

    def __init__(self) -> None:
        self.main: dict[str, WaitingRequest] = {}  # arrival order
        self.late: dict[str, WaitingRequest] = {}  # arrived older than `newest`
        self.late_heap: list[tuple[float, str]] = []  # (arrival, id) over `late`, stale entries skipped
        self.newest = -INF  # latest arrival in `main`

    def __len__(self) -> int:
        return len(self.main) + len(self.late)

    def add(self, request: WaitingRequest) -> None:
        if request.arrival >= self.newest:
            self.main[request.request_id] = request
            self.newest = request.arrival
        else:
            self.late[request.request_id] = request
            heapq.heappush(self.late_heap, (request.arrival, request.request_id))

    def pop(self, request_id: str) -> WaitingRequest:
        request = self.main.pop(request_id, None)
        return request if request is not None else self.late.pop(request_id)

    def replace(self, request: WaitingRequest) -> None:
        """Same id and arrival, new prefix/blocks: keeps its place."""
        (self.main if request.request_id in self.main else self.late)[request.request_id] = request

    def values(self) -> Iterator[WaitingRequest]:
        return chain(self.main.values(), self.late.values())

    def oldest(self) -> float:
        best = next(iter(self.main.values())).arrival if self.main else INF
        if len(self.late_heap) > 2 * len(self.late) + 32:  # mostly stale entries: rebuild, O(late)
            self.late_heap = [(r.arrival, r.request_id) for r in self.late.values()]
            heapq.heapify(self.late_heap)
        heap, late = self.late_heap, self.late
        while heap:
            arrival, request_id = heap[0]
            request = late.get(request_id)
            if request is not None and request.arrival == arrival:
                return min(best, arrival)
            heapq.heappop(heap)
        return best

    def in_order(self) -> Iterator[WaitingRequest]:
        """Members by (arrival, main before late); do not add or remove while iterating."""
        if len(self.late) > 32 + len(self.main) // 4:
            self._fold_late()
        if not self.late:
            return iter(self.main.values())
        return heapq.merge(self.main.values(), sorted(self.late.values(), key=_ARRIVAL), key=_ARRIVAL)

    def _fold_late(self) -> None:
        everyone = sorted(self.values(), key=_ARRIVAL)  # stable: ties keep main first
        self.main = {r.request_id: r for r in everyone}
        self.late, self.late_heap = {}, []
        if everyone:
            self.newest = everyone[-1].arrival


class QuadTree:
    """Waiting requests indexed by prefix length, with per-node counters for density-first search."""

    __slots__ = (
        "_by_id",
        "_leaves",
        "blocks",
        "count",
        "depth",
        "first_leaf",
        "leaf_width",
        "max_len",
        "num_leaves",
        "oldest",
    )

    def __init__(self, max_len: int = DEFAULT_MAX_LEN, leaf_width: int = DEFAULT_LEAF_WIDTH) -> None:
        if leaf_width < 1 or max_len < 1:
            raise ValueError(f"need max_len >= 1 and leaf_width >= 1, got {max_len=} {leaf_width=}")
        depth = 0
        while leaf_width * 4**depth < max_len:
            depth += 1
        self.max_len = max_len
        self.leaf_width = leaf_width
        self.depth = depth  # levels below the root; leaves are at level `depth`
        self.num_leaves: int = 4**depth
        self.first_leaf: int = (4**depth - 1) // 3  # heap index of the leftmost leaf
        nodes = self.first_leaf + self.num_leaves
        self.count = [0] * nodes  # requests in the subtree
        self.blocks = [0] * nodes  # KV blocks of those requests
        self.oldest = [INF] * nodes  # oldest arrival in the subtree
        self._leaves: dict[int, _Leaf] = {}  # leaf node index -> container, only while non-empty
        self._by_id: dict[str, WaitingRequest] = {}

    # --- geometry ------------------------------------------------------------------------------

    def leaf_of(self, prefix_len: int) -> int:
        """Heap index of the leaf holding `prefix_len`."""
        if not 0 <= prefix_len < self.max_len:
            raise ValueError(f"prefix_len {prefix_len} outside [0, {self.max_len})")
        return self.first_leaf + prefix_len // self.leaf_width

    def is_leaf(self, node: int) -> bool:
        return node >= self.first_leaf

    def level(self, node: int) -> int:
        level, start, size = 0, 0, 1
        while node >= start + size:
            start += size
            size *= 4
            level += 1
        return level

    def node_range(self, node: int) -> tuple[int, int]:
        """Token range [lo, hi) that `node` covers (hi may exceed max_len at the right edge)."""
        level = self.level(node)
        width: int = self.leaf_width * 4 ** (self.depth - level)
        position: int = node - (4**level - 1) // 3
        return position * width, (position + 1) * width

    # --- membership ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def get(self, request_id: str) -> WaitingRequest:
        try:
            return self._by_id[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not waiting") from None

    def __iter__(self) -> Iterator[WaitingRequest]:
        return iter(self._by_id.values())

    # --- updates, O(depth) ---------------------------------------------------------------------

    def insert(self, request: WaitingRequest) -> None:
        # hot path (every kv_ready): the leaf-to-root walk is inlined
        request_id, prefix, blocks, arrival = (
            request.request_id,
            request.prefix_len,
            request.blocks,
            request.arrival,
        )
        if request_id in self._by_id:
            raise ValueError(f"request {request_id!r} is already waiting")
        if blocks < 0:
            raise ValueError(f"request {request_id!r} has negative blocks {blocks}")
        node = self.leaf_of(prefix)
        leaf = self._leaves.get(node)
        if leaf is None:
            leaf = self._leaves[node] = _Leaf()
        leaf.add(request)
        self._by_id[request_id] = request
        count, blocks_sum, oldest = self.count, self.blocks, self.oldest
        while True:
            count[node] += 1
            blocks_sum[node] += blocks
            if arrival < oldest[node]:
                oldest[node] = arrival
            if node == 0:
                return
            node = (node - 1) >> 2

    def remove(self, request_id: str) -> WaitingRequest:
        request = self._by_id.pop(request_id, None)
        if request is None:
            raise KeyError(f"request {request_id!r} is not waiting")
        leaf_node = node = self.first_leaf + request.prefix_len // self.leaf_width
        leaf = self._leaves[node]
        leaf.pop(request_id)
        count, blocks_sum, blocks = self.count, self.blocks, request.blocks
        while True:
            count[node] -= 1
            blocks_sum[node] -= blocks
            if node == 0:
                break
            node = (node - 1) >> 2
        if request.arrival <= self.oldest[leaf_node]:  # it was the leaf's oldest (or its last member)
            self._refresh_oldest(leaf_node, leaf)
        return request

    def move(self, request_id: str, prefix_len: int, blocks: int) -> WaitingRequest:
        """The request's prefix changed: same id and arrival, new position. Returns the new value."""
        old = self.get(request_id)
        new = replace(old, prefix_len=prefix_len, blocks=blocks)
        new_node = self.leaf_of(prefix_len)
        if blocks < 0:
            raise ValueError(f"request {request_id!r} has negative blocks {blocks}")
        old_node = self.leaf_of(old.prefix_len)
        if new_node == old_node:  # same leaf, same arrival: replacing the value keeps its place
            self._leaves[old_node].replace(new)
            self._by_id[request_id] = new
            self._add_path(old_node, 0, blocks - old.blocks, new.arrival)
            return new
        self.remove_many((old,))
        self.insert(new)
        return new

    def remove_many(self, requests: Iterable[WaitingRequest]) -> None:
        """Remove waiting requests, one counter walk per touched leaf (how a batch leaves the pool)."""
        by_id = self._by_id
        chosen = {r.request_id: r for r in requests}
        by_leaf: dict[int, list[WaitingRequest]] = {}
        first_leaf, width = self.first_leaf, self.leaf_width
        for request_id, request in chosen.items():
            if by_id.get(request_id) is not request:
                raise KeyError(f"request {request_id!r} is not waiting (or is a stale value)")
            by_leaf.setdefault(first_leaf + request.prefix_len // width, []).append(request)
        for node, group in by_leaf.items():
            leaf = self._leaves[node]
            used = 0
            for request in group:
                leaf.pop(request.request_id)
                del by_id[request.request_id]
                used += request.blocks
            self._add_path(node, -len(group), -used, INF)
            self._refresh_oldest(node, self._leaves[node])

    def pop_oldest(self, leaf_node: int, max_blocks: int, cap: int) -> list[WaitingRequest]:
        """Remove and return the leaf's oldest requests while their blocks fit `max_blocks` (at most `cap`)."""
        leaf = self._leaves.get(leaf_node)
        if leaf is None:
            return []
        taken: list[WaitingRequest] = []
        used = 0
        for request in leaf.in_order():
            if len(taken) == cap or used + request.blocks > max_blocks:
                break
            taken.append(request)
            used += request.blocks
        if taken:
            by_id = self._by_id
            for request in taken:
                leaf.pop(request.request_id)
                del by_id[request.request_id]
            self._add_path(leaf_node, -len(taken), -used, INF)
            self._refresh_oldest(leaf_node, leaf)
        return taken

    def pop_subtree(self, node: int) -> list[WaitingRequest]:
        """Remove and return every request under `node`."""
        taken: list[WaitingRequest] = []
        count, blocks, oldest = self.count, self.blocks, self.oldest
        removed_count, removed_blocks = count[node], blocks[node]
        if removed_count == 0:
            return taken
        stack = [node]
        while stack:  # zero the non-empty part of the subtree
            current = stack.pop()
            if count[current] == 0:
                continue
            count[current] = blocks[current] = 0
            oldest[current] = INF
            if current >= self.first_leaf:
                members = list(self._leaves.pop(current).values())
                taken.extend(members)
                for request in members:
                    del self._by_id[request.request_id]
            else:
                first = 4 * current + 1
                stack.extend((first, first + 1, first + 2, first + 3))
        if node:
            parent = (node - 1) >> 2
            self._add_path(parent, -removed_count, -removed_blocks, INF)
            self._refresh_ancestors(node)
        return taken

    # --- reads used by the search --------------------------------------------------------------

    def members(self, leaf_node: int) -> Iterable[WaitingRequest]:
        leaf = self._leaves.get(leaf_node)
        return list(leaf.values()) if leaf is not None else ()

    def oldest_first(self, leaf_node: int) -> list[WaitingRequest]:
        """The leaf's requests by (arrival, insertion); a snapshot, safe to remove from afterwards."""
        leaf = self._leaves.get(leaf_node)
        return list(leaf.in_order()) if leaf is not None else []

    def leaves_under(self, node: int, reverse: bool = False) -> Iterator[int]:
        """Non-empty leaves of `node`'s subtree in prefix order (descending when `reverse`)."""
        count, first_leaf = self.count, self.first_leaf
        stack = [node]
        while stack:
            current = stack.pop()
            if count[current] == 0:
                continue
            if current >= first_leaf:
                yield current
                continue
            first = 4 * current + 1
            # the stack pops last-in first: push the far children first
            stack.extend(
                (first, first + 1, first + 2, first + 3)
                if reverse
                else (first + 3, first + 2, first + 1, first)
            )

    def leaves_overlapping(self, lo: int, hi: int) -> Iterator[int]:
        """Non-empty leaves whose token range meets [lo, hi] (inclusive), in prefix order."""
        if hi < lo or hi < 0 or lo >= self.max_len:
            return
        first_wanted = max(lo, 0) // self.leaf_width
        last_wanted = min(hi, self.max_len - 1) // self.leaf_width
        count, first_leaf = self.count, self.first_leaf
        stack = [(0, 0, self.num_leaves)]  # (node, its first leaf number, leaves it spans)
        while stack:
            node, start, span = stack.pop()
            if count[node] == 0 or start > last_wanted or start + span <= first_wanted:
                continue
            if node >= first_leaf:
                yield node
                continue
            quarter = span // 4
            first = 4 * node + 1
            for k in (3, 2, 1, 0):  # pushed far-first so they pop in prefix order
                stack.append((first + k, start + k * quarter, quarter))

    def subtree(self, node: int) -> list[WaitingRequest]:
        return [r for leaf in self.leaves_under(node) for r in self._leaves[leaf].values()]

    # --- internals -----------------------------------------------------------------------------

    def _add_path(self, node: int, d_count: int, d_blocks: int, arrival: float) -> None:
        """Add deltas from a leaf up to the root; fold a new arrival into the oldest-arrival mins."""
        count, blocks, oldest = self.count, self.blocks, self.oldest
        while True:
            count[node] += d_count
            blocks[node] += d_blocks
            if arrival < oldest[node]:
                oldest[node] = arrival
            if node == 0:
                return
            node = (node - 1) >> 2

    def _refresh_oldest(self, node: int, leaf: _Leaf) -> None:
        """Recompute a leaf's oldest from its heap, then its ancestors'."""
        value = leaf.oldest()
        if not len(leaf):
            del self._leaves[node]
        if self.oldest[node] != value:
            self.oldest[node] = value
            self._refresh_ancestors(node)

    def _refresh_ancestors(self, node: int) -> None:
        """Each ancestor's oldest = min of its 4 children, stopping at the first that is unchanged."""
        oldest = self.oldest
        while node:
            parent = (node - 1) >> 2
            first = 4 * parent + 1
            value = min(oldest[first], oldest[first + 1], oldest[first + 2], oldest[first + 3])
            if oldest[parent] == value:
                return
            oldest[parent] = value
            node = parent
