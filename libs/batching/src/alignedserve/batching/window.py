"""WindowPolicy: exact narrowest prefix window over the waiting requests sorted by prefix.

The batch is the narrowest prefix interval holding >= K_min requests whose blocks fit (then every
other request in that same interval while the blocks still fit). When no K_min requests fit
together, the largest count that fits, in its narrowest interval. Exact against the brute-force
oracle when blocks do not decrease with prefix length (true for blocks = ceil(prefix/block_size),
plus any constant); otherwise it is the best over runs of consecutive requests.
Cost: O(n) per batch (plus O(n log K_min) when K_min does not fit anywhere); insert/remove O(log n).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from operator import attrgetter, sub

from sortedcontainers import SortedKeyList

from alignedserve.batching.aligned import sort_batch, take_oldest_within
from alignedserve.batching.arrivals import ArrivalOrder, check_request
from alignedserve.batching.search import check_limits
from alignedserve.batching.types import BatchLimits, WaitingRequest

_NEVER = 1 << 62  # gap of an infeasible window
_PREFIX, _BLOCKS = attrgetter("prefix_len"), attrgetter("blocks")


def _key(request: WaitingRequest) -> tuple[int, float, str]:
    return (request.prefix_len, request.arrival, request.request_id)


def narrowest_window(
    prefixes: list[int], sums: list[int], k: int, max_blocks: int, lo: int, hi: int
) -> int | None:
    """Start i in [lo, hi] of the narrowest run of k consecutive requests that fits (None if none).

    prefixes: sorted prefix lengths; sums: block prefix sums (len(prefixes) + 1). Ties: leftmost.
    """
    if hi < lo:
        return None
    gaps = map(sub, prefixes[lo + k - 1 : hi + k], prefixes[lo : hi + 1])
    costs = map(sub, sums[lo + k : hi + k + 1], sums[lo : hi + 1])
    masked = [gap if cost <= max_blocks else _NEVER for gap, cost in zip(gaps, costs, strict=True)]
    best = min(masked)
    return None if best == _NEVER else lo + masked.index(best)


class WindowPolicy:
    """Exact narrowest-window batches over a sorted list. Implements `BatchPolicy`."""

    def __init__(self, starvation_s: float | None = None) -> None:
        if starvation_s is not None and starvation_s < 0:
            raise ValueError(f"starvation_s must be >= 0 or None, got {starvation_s}")
        self.starvation_s = starvation_s
        self._by_id: dict[str, WaitingRequest] = {}
        self._sorted: SortedKeyList = SortedKeyList(key=_key)
        self._order = ArrivalOrder(self._by_id)

    def add(self, request: WaitingRequest) -> None:
        check_request(request)
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self._by_id[request.request_id] = request
        self._sorted.add(request)
        self._order.push(request)

    def remove(self, request_id: str) -> WaitingRequest:
        try:
            request = self._by_id.pop(request_id)
        except KeyError:
            raise KeyError(f"request {request_id!r} is not waiting") from None
        self._sorted.remove(request)
        return request

    def move(self, request_id: str, prefix_len: int, blocks: int) -> None:
        if request_id not in self._by_id:
            raise KeyError(f"request {request_id!r} is not waiting")
        new = replace(self._by_id[request_id], prefix_len=prefix_len, blocks=blocks)
        check_request(new)
        self.remove(request_id)
        self._by_id[request_id] = new
        self._sorted.add(new)  # same arrival: the heap entry stays valid

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def _starved(self, now: float) -> WaitingRequest | None:
        oldest = self._order.oldest()
        if self.starvation_s is None or oldest is None:
            return None
        return oldest if oldest.arrival <= now - self.starvation_s else None

    def form_batch(self, limits: BatchLimits, now: float) -> list[WaitingRequest]:
        check_limits(limits)
        starved = self._starved(now)
        if not self._by_id or (len(self._by_id) < limits.min_requests and starved is None):
            return []
        items: list[WaitingRequest] = list(self._sorted)
        chosen = None
        if starved is not None and starved.blocks <= limits.max_blocks:
            chosen = self._best(items, limits, self._sorted.index(starved))
        if chosen is None:
            chosen = self._best(items, limits, None)
        if chosen is None:
            return []
        batch = items[chosen[0] : chosen[1]]
        for request in batch:
            del self._by_id[request.request_id]
            self._sorted.remove(request)
        return sort_batch(batch)

    def _best(
        self, items: list[WaitingRequest], limits: BatchLimits, must: int | None
    ) -> tuple[int, int] | None:
        """[start, stop) of the chosen run; `must`: an index the run has to contain."""
        n = len(items)
        prefixes = list(map(_PREFIX, items))
        sums = [0, *accumulate(map(_BLOCKS, items))]
        cap = min(n, limits.max_requests if limits.max_requests is not None else n)

        def start_of(k: int) -> int | None:
            lo, hi = (0, n - k) if must is None else (max(0, must - k + 1), min(must, n - k))
            return narrowest_window(prefixes, sums, k, limits.max_blocks, lo, hi)

        k = min(limits.min_requests, cap)
        start = start_of(k)
        if start is None:  # K_min fits nowhere: the largest k that fits (feasibility is monotone in k)
            low, high = 0, k - 1
            while low < high:
                mid = (low + high + 1) // 2
                if start_of(mid) is not None:
                    low = mid
                else:
                    high = mid - 1
            if low == 0:
                return None
            k, start = low, start_of(low)
            assert start is not None
        return self._widen(prefixes, sums, start, start + k, cap, limits.max_blocks)

    @staticmethod
    def _widen(
        prefixes: list[int], sums: list[int], start: int, stop: int, cap: int, max_blocks: int
    ) -> tuple[int, int]:
        """Add neighbours with a prefix inside the run's interval (no wider spread) while they fit."""
        low, high = prefixes[start], prefixes[stop - 1]
        while stop - start < cap:
            if stop < len(prefixes) and prefixes[stop] <= high and sums[stop + 1] - sums[start] <= max_blocks:
                stop += 1
            elif start > 0 and prefixes[start - 1] >= low and sums[stop] - sums[start - 1] <= max_blocks:
                start -= 1
            else:
                break
        return start, stop

    def prefetch_candidates(
        self, lo: int, hi: int, max_blocks: int, max_requests: int
    ) -> list[WaitingRequest]:
        inside = list(self._sorted.irange_key((lo, -float("inf"), ""), (hi, float("inf"), "")))
        chosen = take_oldest_within(inside, lo, hi, max_blocks, max_requests)
        for request in chosen:
            del self._by_id[request.request_id]
            self._sorted.remove(request)
        return chosen
