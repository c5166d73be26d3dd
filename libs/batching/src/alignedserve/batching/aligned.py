"""AlignedPolicy: the quad-tree pool with density-first search, starvation aging and dynamic prefetch."""

from __future__ import annotations

from alignedserve.batching.quadtree import DEFAULT_LEAF_WIDTH, DEFAULT_MAX_LEN, QuadTree
from alignedserve.batching.search import check_limits, density_first_search
from alignedserve.batching.types import BatchLimits, WaitingRequest


def sort_batch(requests: list[WaitingRequest]) -> list[WaitingRequest]:
    """Batches go out ordered by (prefix_len, arrival, id): deterministic and easy to read."""
    return sorted(requests, key=lambda r: (r.prefix_len, r.arrival, r.request_id))


class AlignedPolicy:
    """Prefix-aware batch formation (DESIGN.md §3). Implements `BatchPolicy`.

    `starvation_s`: a request that has waited at least this long (caller's clock) makes the next
    `form_batch` steer to it, so it is in that batch (None: no aging).
    """

    def __init__(
        self,
        max_len: int = DEFAULT_MAX_LEN,
        leaf_width: int = DEFAULT_LEAF_WIDTH,
        starvation_s: float | None = None,
    ) -> None:
        if starvation_s is not None and starvation_s < 0:
            raise ValueError(f"starvation_s must be >= 0 or None, got {starvation_s}")
        self.tree = QuadTree(max_len, leaf_width)
        self.starvation_s = starvation_s

    def add(self, request: WaitingRequest) -> None:
        self.tree.insert(request)

    def remove(self, request_id: str) -> WaitingRequest:
        return self.tree.remove(request_id)

    def move(self, request_id: str, prefix_len: int, blocks: int) -> None:
        self.tree.move(request_id, prefix_len, blocks)

    def __len__(self) -> int:
        return len(self.tree)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.tree

    def starved_before(self, now: float) -> float | None:
        """Arrival time at or before which a request counts as starved (None: none is, or no aging)."""
        if self.starvation_s is None or len(self.tree) == 0:
            return None
        threshold = now - self.starvation_s
        return threshold if self.tree.oldest[0] <= threshold else None

    def form_batch(self, limits: BatchLimits, now: float) -> list[WaitingRequest]:
        check_limits(limits)
        starved_before = self.starved_before(now)
        if len(self.tree) < limits.min_requests and starved_before is None:
            return []  # a saturated worker (room.py): wait for more rather than ship a thin batch
        result = density_first_search(self.tree, limits, starved_before)
        if not result.requests and starved_before is not None:
            # the oldest request alone exceeds B_max and can never go out: do not let it block others
            result = density_first_search(self.tree, limits, None)
        if not result.requests:
            # the descent ended in a leaf whose oldest does not fit (or holds only requests larger than
            # B_max): asked again it would refuse forever while smaller requests wait elsewhere
            cap = limits.max_requests if limits.max_requests is not None else len(self.tree)
            return sort_batch(self.prefetch_candidates(0, self.tree.max_len - 1, limits.max_blocks, cap))
        return sort_batch(list(result.requests))

    def prefetch_candidates(
        self, lo: int, hi: int, max_blocks: int, max_requests: int
    ) -> list[WaitingRequest]:
        chosen = take_oldest_within(
            [r for leaf in self.tree.leaves_overlapping(lo, hi) for r in self.tree.members(leaf)],
            lo,
            hi,
            max_blocks,
            max_requests,
        )
        self.tree.remove_many(chosen)
        return chosen


def take_oldest_within(
    candidates: list[WaitingRequest], lo: int, hi: int, max_blocks: int, max_requests: int
) -> list[WaitingRequest]:
    """Requests with lo <= prefix_len <= hi, oldest first, while their blocks fit (skipping any that do not)."""
    inside = sorted(
        (r for r in candidates if lo <= r.prefix_len <= hi), key=lambda r: (r.arrival, r.request_id)
    )
    chosen: list[WaitingRequest] = []
    budget = max_blocks
    for request in inside:
        if len(chosen) >= max_requests:
            break
        if request.blocks <= budget:
            chosen.append(request)
            budget -= request.blocks
    return chosen
