"""Density-first search over the quad-tree (DESIGN.md §3, the paper's `recursive_dfs`).

From the root, at each node:
  1. its subtree fits (blocks <= B_max, requests <= max_requests) and has >= K_min requests: the batch;
  2. it does not fit: descend into the child with the most requests (the densest; ties: the older);
  3. it fits but has < K_min: keep it all and borrow nearest-first, left siblings then right
     siblings, adding requests while their blocks fit, up to K_min in all.
Beyond the paper (docs/batching.md says why):
  - a leaf that alone does not fit gives its oldest requests that fit;
  - case 3 climbs: when the siblings are exhausted it borrows from the parent's siblings, and so on;
    a direction stops at the first leaf holding a request that no longer fits (the batch's memory is
    full on that side; going further would only widen the prefix range);
  - starvation aging: with `starved_before` set and the subtree's oldest arrival at or before it,
    case 2 descends towards the oldest request instead of the densest child, so the batch contains
    the oldest waiting request.
The search removes what it selects from the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.batching.quadtree import QuadTree
from alignedserve.batching.types import BatchLimits, WaitingRequest


@dataclass(frozen=True, slots=True)
class SearchResult:
    """A batch (already removed from the tree) and where the search found it."""

    requests: tuple[WaitingRequest, ...]
    node: int  # the node the descent stopped at
    case: str  # "fits" (case 1) | "borrowed" (case 3) | "leaf" (a leaf that alone does not fit) | "empty"
    span: tuple[int, int]  # token range [lo, hi) of the subtree every selected request lies in


def check_limits(limits: BatchLimits) -> None:
    if limits.max_blocks < 1 or limits.min_requests < 1:
        raise ValueError(f"need max_blocks >= 1 and min_requests >= 1, got {limits}")
    if limits.max_requests is not None and limits.max_requests < 1:
        raise ValueError(f"max_requests must be >= 1 or None, got {limits.max_requests}")


def density_first_search(
    tree: QuadTree, limits: BatchLimits, starved_before: float | None = None
) -> SearchResult:
    check_limits(limits)
    cap = limits.max_requests if limits.max_requests is not None else len(tree)
    if len(tree) == 0:
        return SearchResult((), 0, "empty", (0, 0))
    node = 0
    while True:
        requests = tree.count[node]
        if tree.blocks[node] <= limits.max_blocks and requests <= cap:
            if requests >= limits.min_requests:
                return SearchResult(tuple(tree.pop_subtree(node)), node, "fits", tree.node_range(node))
            return _borrow(tree, node, limits.max_blocks, min(limits.min_requests, cap))
        if tree.is_leaf(node):
            taken = tree.pop_oldest(node, limits.max_blocks, cap)  # its oldest that fit
            return SearchResult(tuple(taken), node, "leaf", tree.node_range(node))
        node = _choose_child(tree, node, starved_before)


def _choose_child(tree: QuadTree, node: int, starved_before: float | None) -> int:
    first = 4 * node + 1
    children = (first, first + 1, first + 2, first + 3)
    oldest, count = tree.oldest, tree.count
    if starved_before is not None and oldest[node] <= starved_before:
        return min(children, key=lambda child: (oldest[child], child))  # towards the oldest request
    return max(children, key=lambda child: (count[child], -oldest[child]))  # densest, then older


class _Filler:
    """Requests borrowed so far against the remaining block budget and request target."""

    __slots__ = ("budget", "need", "taken", "tree")

    def __init__(self, tree: QuadTree, taken: list[WaitingRequest], budget: int, need: int) -> None:
        self.tree, self.taken, self.budget, self.need = tree, taken, budget, need

    def take_leaf(self, leaf: int) -> bool:
        """Take the leaf's requests (all, or oldest first while they fit); False if one did not fit."""
        tree = self.tree
        if tree.count[leaf] <= self.need and tree.blocks[leaf] <= self.budget:
            self.taken.extend(tree.members(leaf))
            self.need -= tree.count[leaf]
            self.budget -= tree.blocks[leaf]
            return True
        blocked = False
        for request in tree.oldest_first(leaf):
            if self.need == 0:
                break
            if request.blocks <= self.budget:
                self.taken.append(request)
                self.need -= 1
                self.budget -= request.blocks
            else:
                blocked = True
        return not blocked

    def scan(self, sibling: int, reverse: bool) -> bool:
        """Borrow from one sibling subtree nearest leaf first; False once a direction is blocked."""
        for leaf in self.tree.leaves_under(sibling, reverse=reverse):
            if not self.take_leaf(leaf):
                return False
            if self.need == 0:
                break
        return True


def _borrow(tree: QuadTree, node: int, max_blocks: int, target: int) -> SearchResult:
    budget = max_blocks - tree.blocks[node]
    own = tree.pop_subtree(node)
    filler = _Filler(tree, [], budget, target - len(own))
    left_open = right_open = True
    current, reach = node, node
    while current and filler.need > 0 and (left_open or right_open):
        parent = (current - 1) >> 2
        first = 4 * parent + 1
        reach = parent
        # left siblings nearest first (their rightmost leaves first), then the right ones
        for sibling in range(current - 1, first - 1, -1):
            if not left_open or filler.need == 0:
                break
            left_open = filler.scan(sibling, reverse=True)
        for sibling in range(current + 1, first + 4):
            if not right_open or filler.need == 0:
                break
            right_open = filler.scan(sibling, reverse=False)
        current = parent
    tree.remove_many(filler.taken)
    return SearchResult((*own, *filler.taken), node, "borrowed", tree.node_range(reach))
