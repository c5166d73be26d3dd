"""One baseline engine instance (a co-located replica, or a DistServe decode instance): its requests,
KV blocks and the forward pass in flight.

A pass is either a *span* of unchanged decode-only iterations (the same closed form as the aligned
simulator's decode workers, `decode.Span`; an arrival cuts it at the next boundary) or a single *pass*
with prefill chunks, preemptions or admissions. Applying a pass's tokens happens here; the engine
decides, times and counts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from alignedserve.core.blocks import blocks_for
from alignedserve.sim.baselines.steps import StepPlan, StepScheduler, StepView
from alignedserve.sim.decode import Span, advance_tokens, quiet_iterations
from alignedserve.sim.iterstats import IterationStats
from alignedserve.sim.records import UNSET, SimRequest, SimulationError


@dataclass(slots=True)
class Pass:
    """A single forward pass: `decode` requests take one token, `chunks` add prompt tokens."""

    decode: list[SimRequest]
    chunks: list[tuple[SimRequest, int]]
    end: float


class Replica:
    def __init__(self, index: int, capacity_blocks: int, block_size: int, scheduler: StepScheduler) -> None:
        self.index = index
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.scheduler = scheduler
        self.running: dict[str, SimRequest] = {}  # admission order
        self.waiting: deque[SimRequest] = deque()
        self.used_blocks = 0
        self.span: Span | None = None
        self.current: Pass | None = None
        self.version = 0  # bumps whenever the pending boundary event is replaced
        self.stats = IterationStats()

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    @property
    def busy(self) -> bool:
        return self.span is not None or self.current is not None

    def view(self) -> StepView:
        return StepView(
            list(self.running.values()), self.waiting, self.free_blocks, self.capacity_blocks, self.block_size
        )

    # --- applying a plan ----------------------------------------------------------------------------

    def preempt(self, request_id: str) -> SimRequest:
        """Drop its KV; it goes to the front of the waiting queue and will recompute what it had."""
        r = self.running.pop(request_id)
        self.used_blocks -= blocks_for(r.prefix, self.block_size)
        if r.prefix >= r.target:  # decoding: recompute the prompt, its output and the token it holds
            r.target = r.prefix + 1
        r.prefix = 0
        self.waiting.appendleft(r)
        self.stats.evictions += 1
        return r

    def take_waiting(self, ids: list[str]) -> list[SimRequest]:
        """Admit the waiting requests `ids`: a scheduler takes them from the head of the queue, in order."""
        taken = []
        for request_id in ids:
            if not self.waiting or self.waiting[0].request_id != request_id:
                raise SimulationError(f"replica {self.index}: {request_id!r} is not next in its FCFS queue")
            r = self.waiting.popleft()
            self.running[request_id] = r
            self.used_blocks += blocks_for(r.prefix, self.block_size)
            taken.append(r)
        return taken

    def single_pass(self, plan: StepPlan, end: float) -> Pass:
        """The plan's pass (waiting ids it names are admitted); checks every token's block fits."""
        waiting_ids = [i for i, _ in plan.chunks if i not in self.running]
        self.take_waiting(waiting_ids)
        decode = [self.running[i] for i in plan.decode]
        chunks = [(self.running[i], n) for i, n in plan.chunks]
        bs = self.block_size
        grow = sum(1 for r in decode if r.prefix % bs == 0)
        grow += sum(blocks_for(r.prefix + n, bs) - blocks_for(r.prefix, bs) for r, n in chunks)
        if grow > self.free_blocks:
            raise SimulationError(
                f"replica {self.index}: the pass needs {grow} blocks, {self.free_blocks} free"
            )
        return Pass(decode, chunks, end)

    def quiet_iterations(self) -> int:
        return quiet_iterations(self.running.values(), self.free_blocks, self.block_size)

    # --- ending a pass ------------------------------------------------------------------------------

    def end_span(self, span: Span) -> list[SimRequest]:
        self.stats.add_span(span.cost, span.parts, span.iterations, span.stall_s)
        self.used_blocks, finished = advance_tokens(
            self.running.values(), span, span.iterations, self.block_size, self.stats
        )
        return finished

    def end_pass(self, p: Pass) -> list[SimRequest]:
        """Apply the pass's tokens; returns the requests that finished."""
        bs = self.block_size
        finished: list[SimRequest] = []
        produced = 0
        for r in p.decode:
            self.used_blocks += 1 if r.prefix % bs == 0 else 0
            r.prefix += 1
            produced += self._token(r, p.end, finished)
        for r, n in p.chunks:
            self.used_blocks += blocks_for(r.prefix + n, bs) - blocks_for(r.prefix, bs)
            r.prefix += n
            if r.prefix < r.target:
                continue  # more chunks to come
            if r.first_token_at == UNSET:  # the prompt's pass makes the first token (TTFT)
                r.first_token_at = p.end
                if r.remaining == 0:
                    finished.append(r)
            else:  # a recomputation ends with the token the preempted request was about to make
                produced += self._token(r, p.end, finished)
        self.stats.count_tokens(produced, p.end, p.end, lambda _: 0)
        return finished

    def _token(self, r: SimRequest, end: float, finished: list[SimRequest]) -> int:
        r.remaining -= 1
        if r.decode_tokens == 0:
            r.first_decode_at = end
        r.decode_tokens += 1
        r.last_token_at = end
        if r.remaining == 0:
            finished.append(r)
        return 1

    def leave(self, r: SimRequest) -> None:
        del self.running[r.request_id]
        self.used_blocks -= blocks_for(r.prefix, self.block_size)
