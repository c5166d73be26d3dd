"""Which requests run in the next engine iteration, and the KV blocks they need. No torch, no clocks.

Prefill first: waiting requests in the prefill order (first come first served, or shortest remaining
prompt first), in chunks within `max_prefill_tokens`, while blocks and decode seats last. Otherwise one
decode iteration over every running request; when a running request cannot get its next block, the
newest running request is preempted (blocks freed, recomputed later from its prompt and outputs so far).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from alignedserve.core.blocks import BlockAllocator, OutOfBlocks, blocks_for
from alignedserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # = request.num_computed when scheduled
    length: int

    @property
    def completes(self) -> bool:
        """After this chunk every token of the request is cached, so a new token is sampled."""
        return self.start + self.length == self.request.num_tokens


PrefillOrder = Callable[[Sequence[Request]], Iterable[Request]]


def first_come(waiting: Sequence[Request]) -> Iterable[Request]:
    return waiting


@dataclass(frozen=True, slots=True)
class ShortestRemaining:
    """Fewest prompt tokens left first (ties: first come), after every overdue request in waiting order.
    A short prompt then waits for one chunk of a long one, not for all of it; the long one takes the
    budget the short ones leave in every forward, and all of it once it is overdue.

    A waiting request is overdue once the prompt tokens prefilled for others while it waited reach
    `overtake_ratio` times its own length: short prompts that keep arriving do not hold a long one back
    for ever, whether they leave it no token of a forward or a few. The bound is in the prompt's own
    units, so it is the same on every machine however long a forward takes (a count of forwards or
    seconds is not): a prompt of L tokens waits for about ratio * L tokens of other prompts at most, plus
    a forward's budget (docs/benchmarks.md, "A long prompt's wait, in its own units")."""

    overtake_ratio: float

    def __call__(self, waiting: Sequence[Request]) -> Iterable[Request]:
        return sorted(
            waiting, key=lambda r: (0, 0) if self.overdue(r) else (1, r.num_tokens - r.num_computed)
        )

    def overdue(self, request: Request) -> bool:
        return request.overtaken_tokens >= self.overtake_ratio * request.num_tokens


def _first_come_order(_overtake_ratio: float) -> PrefillOrder:
    return first_come


# each order by name, built from the engine's `prefill_overtake_ratio` (which only "shortest" uses)
PREFILL_ORDERS: dict[str, Callable[[float], PrefillOrder]] = {
    "fcfs": _first_come_order,
    "shortest": ShortestRemaining,
}


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_prefill_tokens: int,
        prefill_order: PrefillOrder = first_come,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_order = prefill_order
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule_prefill(self) -> list[ScheduledChunk]:
        budget = self.max_prefill_tokens
        seats = self.max_num_seqs - len(self.running)
        chunks: list[ScheduledChunk] = []
        for request in self.prefill_order(self.waiting):
            if budget == 0 or (seats <= 0 and not request.park_after_prefill):
                break
            length = min(request.num_tokens - request.num_computed, budget)
            try:
                self._reserve(request, request.num_computed + length)
            except OutOfBlocks:
                break  # in order: later requests wait behind this one
            chunks.append(ScheduledChunk(request, request.num_computed, length))
            budget -= length
            seats -= 0 if request.park_after_prefill else 1
        self._count_overtaking(chunks)
        return chunks

    def _count_overtaking(self, chunks: list[ScheduledChunk]) -> None:
        """A forward runs `chunks`: every waiting request was overtaken by the tokens the others got."""
        total = sum(chunk.length for chunk in chunks)
        own = {chunk.request.request_id: chunk.length for chunk in chunks}
        for request in self.waiting:
            request.overtaken_tokens += total - own.get(request.request_id, 0)

    def blocks_pending(self) -> int:
        """Blocks the waiting requests still need for their whole prompt beyond what they hold."""
        size = self.allocator.block_size
        held = self.allocator.capacity_tokens
        return sum(
            blocks_for(r.num_tokens, size)
            - (held(r.request_id) // size if r.request_id in self.allocator else 0)
            for r in self.waiting
        )

    def finish_prefill(self, chunk: ScheduledChunk) -> None:
        """Account a run chunk; a completed request leaves the waiting queue."""
        request = chunk.request
        request.num_computed = chunk.start + chunk.length
        if chunk.completes:
            self.waiting.remove(request)
            if request.park_after_prefill:
                request.status = RequestStatus.PARKED
                self.parked[request.request_id] = request
            else:
                self.add_running(request)

    def schedule_decode(self) -> list[Request]:
        """Running requests with a block for their next token, preempting the newest when short."""
        index = 0
        while index < len(self.running):
            request = self.running[index]
            try:
                self._reserve(request, request.num_computed + 1)
                index += 1
            except OutOfBlocks:
                self._preempt(self.running[-1])
        return list(self.running)

    def remove(self, request: Request) -> None:
        """Drop the request from whichever queue holds it and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request.request_id in self.parked:
            del self.parked[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request.request_id)

    def _reserve(self, request: Request, tokens: int) -> None:
        if request.request_id in self.allocator:
            self.allocator.extend(request.request_id, tokens)
        else:
            self.allocator.allocate(request.request_id, tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        # Ahead of fresh requests but behind partly prefilled ones, which hold blocks and must finish.
        position = next((i for i, r in enumerate(self.waiting) if r.num_computed == 0), len(self.waiting))
        self.waiting.insert(position, request)
        self.num_preemptions += 1
