"""Per-iteration batch-level scheduler (DESIGN.md §4), a pure function of the iteration state.

After each decode iteration:
  1. finished requests leave and free their blocks;
  2. if the next iteration lacks KV blocks (counting the new block of every request whose next token
     starts one), evict victims to the candidate request buffer until it fits: the longest request,
     or during a batch switch the longest of the older batch (smaller batch_id), which ends the
     switch sooner;
  3. else admit, with the room left: from the candidate request buffer (requests that belong with the
     running batch) those that fit, each with its own next-token block; only if that buffer is empty,
     from the candidate batch buffer (this starts a batch switch). At most `max_batch` run.
Beyond the paper: with `growth_reserve` g > 0 an admission must also leave g blocks per request then
running free (one block covers the next `block_size` iterations of a request's growth). At the memory
limit the paper's rule admits a request as soon as it fits, the batch's growth then overflows within a
few iterations and step 2 evicts the longest, often the request just admitted, back and forth — two KV
transfers each time, and the evicted request makes no progress. The reserve is waived for the first
request into an empty worker, so anything that fits a worker can always run.
"""

from __future__ import annotations

from alignedserve.batching.types import IterationPlan, IterationState, ScheduledRequest
from alignedserve.core.blocks import blocks_for


def next_token_blocks(request: ScheduledRequest, block_size: int) -> int:
    """Blocks the request must add to hold its next token: 1 when that token starts a new block."""
    return max(0, blocks_for(request.prefix_len + 1, block_size) - request.blocks)


def _check(state: IterationState) -> None:
    if state.block_size < 1 or state.free_blocks < 0:
        raise ValueError(
            f"need block_size >= 1 and free_blocks >= 0, got {state.block_size}, {state.free_blocks}"
        )
    if state.max_batch is not None and state.max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 or None, got {state.max_batch}")
    if state.growth_reserve < 0:
        raise ValueError(f"growth_reserve must be >= 0, got {state.growth_reserve}")
    running = [r.request_id for r in state.running]
    everyone = running + [r.request_id for r in (*state.candidate_requests, *state.candidate_batch)]
    if len(set(everyone)) != len(everyone):
        raise ValueError("a request appears twice across running and the candidate buffers")
    if not state.finished <= set(running):
        raise ValueError(f"finished requests not running: {sorted(state.finished - set(running))}")


def _victim(running: list[ScheduledRequest]) -> ScheduledRequest:
    """The longest request; during a batch switch, the longest of the older batch."""
    oldest_batch = min(r.batch_id for r in running)
    pool = (
        running
        if all(r.batch_id == oldest_batch for r in running)
        else [r for r in running if r.batch_id == oldest_batch]
    )
    return max(pool, key=lambda r: (r.prefix_len, r.blocks, r.request_id))


def _admit(
    source: tuple[ScheduledRequest, ...], room: int, slots: int, block_size: int, reserve: _Reserve
) -> tuple[list[ScheduledRequest], int]:
    """Buffer order, skipping those that do not fit; returns the admitted and the room left."""
    admitted: list[ScheduledRequest] = []
    for request in source:
        if len(admitted) == slots:
            break
        cost = request.blocks + next_token_blocks(request, block_size)
        if cost + reserve.after(len(admitted) + 1) <= room:
            admitted.append(request)
            room -= cost
    return admitted, room


class _Reserve:
    """Blocks an admission must leave free: `per_request` for every request then running, none for the
    first request into an empty worker."""

    __slots__ = ("per_request", "running")

    def __init__(self, per_request: int, running: int) -> None:
        self.per_request, self.running = per_request, running

    def after(self, admitted: int) -> int:
        """The reserve once `admitted` candidates have joined the running ones."""
        total = self.running + admitted
        return 0 if total <= 1 else self.per_request * total


def plan_iteration(state: IterationState) -> IterationPlan:
    _check(state)
    bs = state.block_size
    finished = tuple(r.request_id for r in state.running if r.request_id in state.finished)
    running = [r for r in state.running if r.request_id not in state.finished]
    free = state.free_blocks + sum(r.blocks for r in state.running if r.request_id in state.finished)
    need = sum(next_token_blocks(r, bs) for r in running)

    if need > free:  # case 3: evict until the next iteration fits
        evicted: list[str] = []
        while need > free:
            victim = _victim(running)
            running.remove(victim)
            evicted.append(victim.request_id)
            free += victim.blocks
            need -= next_token_blocks(victim, bs)
        switching = len({r.batch_id for r in running}) > 1
        return IterationPlan(finished, tuple(evicted), (), "", switching, free - need)

    slots = len(state.running) + len(state.candidate_requests) + len(state.candidate_batch)
    if state.max_batch is not None:
        slots = max(0, state.max_batch - len(running))
    reserve = _Reserve(state.growth_reserve, len(running))
    if state.candidate_requests:  # case 1: requests that belong with the running batch
        admitted, room = _admit(state.candidate_requests, free - need, slots, bs, reserve)
        source = "requests"
    else:  # case 2: the next batch (a batch switch while the current one still runs)
        admitted, room = _admit(state.candidate_batch, free - need, slots, bs, reserve)
        source = "batch"
    batch_ids = {r.batch_id for r in running} | {r.batch_id for r in admitted}
    return IterationPlan(
        finished=finished,
        evicted=(),
        admitted=tuple(r.request_id for r in admitted),
        admitted_from=source if admitted else "",
        switching=len(batch_ids) > 1,
        free_blocks_after=room,
    )
