"""Arrival order over a dict of live requests: a min-heap of (arrival, request_id), pruned lazily."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from alignedserve.batching.types import WaitingRequest


def check_request(request: WaitingRequest) -> None:
    if request.prefix_len < 0 or request.blocks < 0:
        raise ValueError(f"request {request.request_id!r} has a negative prefix_len or blocks: {request}")


class ArrivalOrder:
    """Oldest-first view of `live` (the owner's id -> request dict); stale heap entries are skipped."""

    __slots__ = ("_heap", "_live")

    def __init__(self, live: dict[str, WaitingRequest]) -> None:
        self._live = live
        self._heap: list[tuple[float, str]] = []

    def push(self, request: WaitingRequest) -> None:
        heapq.heappush(self._heap, (request.arrival, request.request_id))

    def _current(self, entry: tuple[float, str]) -> WaitingRequest | None:
        request = self._live.get(entry[1])
        return request if request is not None and request.arrival == entry[0] else None

    def oldest(self) -> WaitingRequest | None:
        heap = self._heap
        while heap and self._current(heap[0]) is None:
            heapq.heappop(heap)
        if len(heap) > 2 * len(self._live) + 32:  # mostly stale: rebuild, O(n)
            self._heap = heap = [(r.arrival, r.request_id) for r in self._live.values()]
            heapq.heapify(heap)
        return self._current(heap[0]) if heap else None

    def pop_oldest(self) -> None:
        """Drop the head entry; call right after `oldest()` returned the request to drop."""
        heapq.heappop(self._heap)

    def oldest_first(self) -> Iterator[WaitingRequest]:
        """Live requests by (arrival, request_id); pops from a copy, so O(n) to start."""
        heap = list(self._heap)
        seen: set[str] = set()
        while heap:
            entry = heapq.heappop(heap)
            request = self._current(entry)
            if request is not None and entry[1] not in seen:
                seen.add(entry[1])
                yield request
