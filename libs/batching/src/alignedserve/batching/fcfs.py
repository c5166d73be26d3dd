"""FcfsPolicy: first come, first served (the disaggregated FCFS baseline, DESIGN.md §5)."""

from __future__ import annotations

from dataclasses import replace

from alignedserve.batching.aligned import take_oldest_within
from alignedserve.batching.arrivals import ArrivalOrder, check_request
from alignedserve.batching.search import check_limits
from alignedserve.batching.types import BatchLimits, WaitingRequest


class FcfsPolicy:
    """Oldest first while the blocks fit, up to `max_requests`. Implements `BatchPolicy`.

    Strict arrival order: the first request that does not fit ends the batch (no overtaking). A
    request larger than B_max on its own can never be dispatched and is passed over. It never waits
    for K_min (`limits.min_requests` is ignored): the baseline admits into decode as soon as memory frees.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, WaitingRequest] = {}
        self._order = ArrivalOrder(self._by_id)

    def add(self, request: WaitingRequest) -> None:
        check_request(request)
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self._by_id[request.request_id] = request
        self._order.push(request)

    def remove(self, request_id: str) -> WaitingRequest:
        try:
            return self._by_id.pop(request_id)
        except KeyError:
            raise KeyError(f"request {request_id!r} is not waiting") from None

    def move(self, request_id: str, prefix_len: int, blocks: int) -> None:
        if request_id not in self._by_id:
            raise KeyError(f"request {request_id!r} is not waiting")
        moved = replace(self._by_id[request_id], prefix_len=prefix_len, blocks=blocks)
        check_request(moved)
        self._by_id[request_id] = moved

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def form_batch(self, limits: BatchLimits, now: float) -> list[WaitingRequest]:
        check_limits(limits)  # K_min plays no part: FCFS admits whatever waits, as memory frees
        cap = limits.max_requests if limits.max_requests is not None else len(self._by_id)
        taken: list[WaitingRequest] = []
        oversized: list[WaitingRequest] = []  # can never fit a worker: must not block the queue
        used = 0
        while len(taken) < cap:
            head = self._order.oldest()
            if head is None or (head.blocks <= limits.max_blocks and used + head.blocks > limits.max_blocks):
                break
            self._order.pop_oldest()
            if head.blocks > limits.max_blocks:
                oversized.append(head)
                continue
            del self._by_id[head.request_id]
            taken.append(head)
            used += head.blocks
        for request in oversized:
            self._order.push(request)
        return taken

    def prefetch_candidates(
        self, lo: int, hi: int, max_blocks: int, max_requests: int
    ) -> list[WaitingRequest]:
        """O(n) scan: FCFS keeps no prefix index (it is the baseline without alignment)."""
        chosen = take_oldest_within(list(self._by_id.values()), lo, hi, max_blocks, max_requests)
        for request in chosen:
            del self._by_id[request.request_id]
        return chosen
