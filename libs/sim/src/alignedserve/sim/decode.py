"""A simulated decode worker: its running batch, candidate buffers, and spans of unchanged iterations.

The real per-iteration scheduler decides at every iteration boundary the worker processes. Between a
quiet plan (nothing finished, evicted or admitted) and the next event that could change the answer — a
request finishing, a block-boundary crossing that no longer fits, a candidate becoming ready — every
iteration has the same batch, so the worker runs them as one *span*: k iterations whose durations the
cost model gives in closed form (`SpanCost`). Admission only gets harder inside a span (free blocks
shrink, buffers are unchanged), so the skipped plans would have been empty too; the simulator's
`exact_iterations` mode calls the scheduler at every iteration to check that equivalence in tests.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from alignedserve.batching.room import DecodeRoom
from alignedserve.batching.types import IterationState, ScheduledRequest
from alignedserve.sim.cost import DecodeParts, SpanCost
from alignedserve.sim.iterstats import IterationStats
from alignedserve.sim.records import SimRequest


@dataclass(slots=True)
class Span:
    """Iterations committed to run back to back from `start` (after `stall_s` of KV transfers)."""

    start: float
    stall_s: float
    iterations: int
    cost: SpanCost
    parts: DecodeParts  # where the first iteration's time goes (iterstats.py)

    def offset(self, iterations: int) -> float:
        """Time from `start` to the end of the first `iterations` iterations."""
        return self.stall_s + self.cost.total(iterations)

    def first_boundary_at_or_after(self, when: float) -> int:
        """Fewest iterations (>= 1) whose end is at or after `when`."""
        budget = when - self.start - self.stall_s
        k = self.cost.iterations_within(budget)
        if self.cost.total(k) < budget or k == 0:
            k += 1
        return k


class DecodeWorker:
    """State of one decode GPU. The cluster drives it; the scheduler decides for it."""

    def __init__(
        self,
        index: int,
        capacity_blocks: int,
        block_size: int,
        max_batch: int | None,
        growth_reserve: int = 0,
    ) -> None:
        self.index = index
        self.growth_reserve = growth_reserve
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.max_batch = max_batch
        self.running: dict[str, SimRequest] = {}
        self.used_blocks = 0
        self.batch_counts: dict[int, int] = {}  # origin batch id -> running requests from it
        self.candidate_batch: dict[str, SimRequest] = {}
        self.candidate_requests: dict[str, SimRequest] = {}
        self.span: Span | None = None
        self.wake_at: float | None = None  # pending boundary of a worker with nothing running
        self.version = 0  # bumps whenever the pending boundary event is replaced
        self.staging_batch = False  # the batcher has formed the next batch for it (maybe in transfer)
        self.stats = IterationStats()

    # --- membership ---------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    @property
    def idle(self) -> bool:
        """Nothing running and nothing waiting for it: the batcher should not wait for a full batch."""
        return not self.running and not self.candidate_batch and not self.candidate_requests

    def room(self) -> DecodeRoom:
        """What the batcher sees of it for the load-adaptive K_min (batching/room.py)."""
        return DecodeRoom(
            occupied=len(self.running) + len(self.candidate_requests),
            free_blocks=self.free_blocks,
            max_running=self.max_batch,
        )

    def join(self, request: SimRequest) -> None:
        self.running[request.request_id] = request
        self.used_blocks += request.blocks
        self.batch_counts[request.batch_id] = self.batch_counts.get(request.batch_id, 0) + 1

    def leave(self, request_id: str) -> SimRequest:
        request = self.running.pop(request_id)
        self.used_blocks -= request.blocks
        left = self.batch_counts[request.batch_id] - 1
        if left:
            self.batch_counts[request.batch_id] = left
        else:
            del self.batch_counts[request.batch_id]
        return request

    def growth_blocks(self) -> int:
        """Blocks the next iteration allocates: one for every request whose next token opens a block."""
        size = self.block_size
        return sum(1 for r in self.running.values() if r.prefix % size == 0)

    def newest_batch_range(self) -> tuple[int, int, int] | None:
        """(batch id, min prefix, max prefix) of the newest origin batch running, for dynamic prefetch."""
        if not self.batch_counts:
            return None
        newest = max(self.batch_counts)
        prefixes = [r.prefix for r in self.running.values() if r.batch_id == newest]
        return newest, min(prefixes), max(prefixes)

    # --- scheduler input ------------------------------------------------------------------------------

    def state(self, finished: frozenset[str], now: float) -> IterationState:
        size = self.block_size
        return IterationState(
            running=tuple(
                ScheduledRequest(r.request_id, r.prefix, -(-r.prefix // size), r.batch_id)
                for r in self.running.values()
            ),
            finished=finished,
            free_blocks=self.free_blocks,
            candidate_requests=tuple(
                r.scheduled() for r in self.candidate_requests.values() if r.ready_at <= now
            ),
            candidate_batch=tuple(r.scheduled() for r in self.candidate_batch.values() if r.ready_at <= now),
            block_size=self.block_size,
            max_batch=self.max_batch,
            growth_reserve=self.growth_reserve,
        )

    def next_ready_after(self, now: float) -> float | None:
        """When the next candidate still in transfer becomes ready."""
        pending = [
            r.ready_at for buf in (self.candidate_batch, self.candidate_requests) for r in buf.values()
        ]
        later = [t for t in pending if t > now]
        return min(later) if later else None

    # --- spans ---------------------------------------------------------------------------------------

    def quiet_iterations(self) -> int:
        """Most iterations the running batch can run unchanged (`quiet_iterations` below)."""
        return quiet_iterations(self.running.values(), self.free_blocks, self.block_size)

    def switching_in(self) -> bool:
        """The newest running batch is still being admitted from the candidate batch buffer."""
        staged = next(iter(self.candidate_batch.values()), None)
        return staged is not None and staged.batch_id == max(self.batch_counts)

    def advance(self, span: Span, iterations: int) -> list[SimRequest]:
        """Apply `iterations` iterations of `span`; returns the requests that finished."""
        stats = self.stats
        running = self.running.values()
        lo, hi = min(r.prefix for r in running), max(r.prefix for r in running)
        misaligned = False
        if len(self.batch_counts) > 1:
            stats.mixed_iterations += iterations
            if self.switching_in():
                stats.switch_iterations += iterations
            misaligned = origins_apart(running)
        stats.spread_iterations += (hi - lo) * iterations
        bubble = stats.add_span(span.cost, span.parts, iterations, span.stall_s)
        if misaligned:
            stats.misaligned_iterations += iterations
            stats.misaligned_bubble_s += bubble
        self.used_blocks, finished = advance_tokens(running, span, iterations, self.block_size, stats)
        return finished


def origins_apart(running: Iterable[SimRequest]) -> bool:
    """Whether the origin batches' prefix ranges leave a gap: the iteration mixes prefix lengths that no
    single batch would, i.e. it violates the alignment (the paper's misaligned batch-switch iteration)."""
    ranges: dict[int, list[int]] = {}
    for r in running:
        found = ranges.get(r.batch_id)
        if found is None:
            ranges[r.batch_id] = [r.prefix, r.prefix]
        elif r.prefix < found[0]:
            found[0] = r.prefix
        elif r.prefix > found[1]:
            found[1] = r.prefix
    reach = -1
    for lo, hi in sorted(ranges.values()):
        if reach >= 0 and lo > reach:
            return True
        reach = max(reach, hi)
    return False


def quiet_iterations(running: Collection[SimRequest], free: int, size: int) -> int:
    """Most iterations a batch can run unchanged: until a request finishes, or until the blocks it grows
    into no longer fit the `free` ones (then the scheduler must evict or preempt)."""
    until_finish = min(r.remaining for r in running)
    # offsets: iterations until each request's next token opens a new block
    offsets = [(-r.prefix) % size for r in running]
    if len(offsets) * (until_finish // size + 1) <= free:
        return until_finish

    def grown(k: int) -> int:  # blocks allocated over the first k iterations
        return sum(1 + (k - 1 - off) // size for off in offsets if off < k)

    lo, hi = 1, until_finish  # grown(1) <= free: the scheduler checked this iteration fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if grown(mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def advance_tokens(
    running: Collection[SimRequest], span: Span, iterations: int, size: int, stats: IterationStats
) -> tuple[int, list[SimRequest]]:
    """Every request of an unchanged batch decodes `iterations` tokens; returns (blocks held, finished).
    Counts the tokens in `stats`, and those done by each of its throughput marks."""
    end = span.start + span.offset(iterations)
    first_end = span.start + span.offset(1)
    finished = []
    used = 0
    for r in running:
        prefix = r.prefix = r.prefix + iterations
        r.remaining -= iterations
        if r.decode_tokens == 0:
            r.first_decode_at = first_end
        r.decode_tokens += iterations
        r.last_token_at = end
        used += -(-prefix // size)  # blocks_for, inlined: this loop is the simulator's hot path
        if r.remaining == 0:
            finished.append(r)
    n = len(running)

    def done_by(mark: float) -> int:
        return min(span.cost.iterations_within(mark - span.start - span.stall_s), iterations) * n

    stats.count_tokens(iterations * n, span.start, end, done_by)
    return used, finished
