"""Discrete-event replay of a workload through prefill -> KV pool -> batcher -> decode workers.

Everything that decides is the product's own code: the batch policy (`BatchPolicy.form_batch`,
`prefetch_candidates`) and the per-iteration scheduler (`plan_iteration`). The simulator only moves
time: prefill passes, KV transfers and decode iterations take what the cost model says.

Where KV bytes travel (DESIGN.md §2, §4):
- prefill GPU -> host pool over the prefill worker's PCIe link, after its prefill pass;
- prefetch on: a formed batch (and dynamically prefetched requests) is staged host -> prefill GPU over
  that same PCIe link while the decode worker keeps running; admission and eviction then move KV
  prefill GPU <-> decode GPU over NVLink;
- prefetch off: candidates stay in the host pool; admission and eviction move KV over the decode GPU's
  PCIe link.
An admission or eviction transfer stalls the decode worker before its next iteration (the scheduling
latency the paper's GPU prefetch cuts).

Requests enter through the configured arrival process (`alignedserve.core.workloads.arrivals`, the
load generator's own): their own timestamps (open loop) or a closed loop that lets a new request in
whenever one completes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from alignedserve.batching.room import load_adapted
from alignedserve.batching.types import (
    BatchLimits,
    BatchPolicy,
    IterationPlan,
    IterationState,
    WaitingRequest,
)
from alignedserve.core.workloads.arrivals import OPEN_LOOP, ArrivalProcess
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.sim.compute import COMPUTE, Ends
from alignedserve.sim.cost import CostModel, Link
from alignedserve.sim.decode import DecodeWorker, Span
from alignedserve.sim.events import EventQueue
from alignedserve.sim.iterstats import arrival_mark
from alignedserve.sim.metrics import Metrics
from alignedserve.sim.records import FifoLink, SimRequest, SimulationError

Planner = Callable[[IterationState], IterationPlan]

# event kinds, in the order ties at the same instant are handled
_PREFILL_DONE, _KV_READY, _BATCH_TICK, _DECODE_BOUNDARY = 0, 1, 2, 3
_PREFILL, _DECODE = "prefill", "decode"  # compute jobs: (kind, worker index)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    prefill_workers: int = 4
    decode_workers: int = 4
    prefetch: bool = True  # stage batches on the prefill GPUs (GPU-prefetch-for-GPU)
    dynamic_prefetch: bool = True  # pull waiting requests in the running batch's range into its buffer
    min_batch: int = 128  # K_min
    max_batch: int | None = 256  # running requests a decode worker takes at most
    fill: float = 1.0  # share of a decode worker's blocks a new batch may take (the rest: room to grow)
    range_slack: int = 0  # dynamic prefetch also takes prefixes this far above the running range
    max_prefill_tokens: int = 8192  # tokens one prefill pass takes (at least one whole prompt)
    # re-ask the policy this often while a worker waits: only answers that change with time need it
    # (starvation aging); None: ask only when the pool or a worker changes
    batcher_retry_s: float | None = None
    exact_iterations: bool = False  # call the scheduler at every iteration (no spans): for checking
    growth_reserve: int = 0  # IterationState.growth_reserve: blocks per running request an admission leaves
    compute: str = "dedicated"  # engines on devices of their own, or "shared" cores (compute.py)
    arrivals: ArrivalProcess = OPEN_LOOP  # when requests enter (open loop: their own timestamps)


class Cluster:
    """One simulation run. `run()` returns the metrics; a Cluster is used once."""

    def __init__(
        self,
        specs: Sequence[RequestSpec],
        cost: CostModel,
        policy: BatchPolicy,
        planner: Planner,
        config: ClusterConfig,
    ) -> None:
        if config.prefill_workers < 1 or config.decode_workers < 1:
            raise ValueError("need at least one prefill and one decode worker")
        if not 0 < config.fill <= 1:
            raise ValueError(f"fill must be in (0, 1], got {config.fill}")
        if config.compute not in COMPUTE:
            raise ValueError(f"compute must be one of {sorted(COMPUTE)}, got {config.compute!r}")
        self.compute = COMPUTE[config.compute]()
        self.cost = cost
        self.policy = policy
        self.planner = planner
        self.config = config
        block = cost.block_size
        self.by_index = [
            SimRequest(i, s.arrival_s, s.input_len, s.output_len, block) for i, s in enumerate(specs)
        ]
        capacity = cost.decode_capacity_blocks
        self.limits = BatchLimits(
            max_blocks=max(1, int(capacity * config.fill)),
            min_requests=config.min_batch,
            max_requests=config.max_batch,
        )
        too_long = [
            r for r in self.by_index if r.remaining > 0 and r.input_len + r.output_len > capacity * block
        ]
        if too_long:
            raise ValueError(
                f"{len(too_long)} requests need more KV than a decode worker holds ({capacity * block} tokens), "
                f"e.g. {too_long[0].input_len}+{too_long[0].output_len} tokens"
            )
        self.decoders = [
            DecodeWorker(d, capacity, block, config.max_batch, config.growth_reserve)
            for d in range(config.decode_workers)
        ]
        self.arrivals = config.arrivals.start(self.by_index)
        self.prefill_links = [FifoLink() for _ in range(config.prefill_workers)]
        self.prefill_busy: list[list[SimRequest] | None] = [None] * config.prefill_workers
        self.prefill_version = [0] * config.prefill_workers  # a re-timed pass leaves stale done events
        self.prefill_queue: deque[SimRequest] = deque()
        self.waiting: dict[str, SimRequest] = {}  # in the policy's pool
        self.queue = EventQueue()
        self._push = self.queue.push
        self.tick_at: float | None = None
        self.next_batch_id = 0
        self.arrived = 0
        self.metrics = Metrics(len(self.by_index), cost.block_size * cost.kv_bytes_per_token)

    # --- the run ------------------------------------------------------------------------------------

    def run(self) -> Metrics:
        wall = time.perf_counter()
        handlers = (self._prefill_done, self._kv_ready, self._batch_tick, self._decode_boundary)
        self.queue.drain(self.arrivals, self._arrive, handlers)
        self._check_drained()
        self.metrics.finish([d.stats for d in self.decoders], time.perf_counter() - wall)
        return self.metrics

    def _arrive(self, request: SimRequest) -> None:
        self.arrived += 1
        mark = arrival_mark(self.arrived, len(self.by_index))
        if mark is not None:  # a throughput window starts or ends here (iterstats.MARKS)
            for worker in self.decoders:
                worker.stats.marks[mark] = request.arrival
        self.prefill_queue.append(request)
        self._start_prefills(request.arrival)

    def _complete(self, request: SimRequest, now: float) -> None:
        self.metrics.complete(request)
        self.arrivals.completed(now)

    def _check_drained(self) -> None:
        if self.metrics.completed != len(self.by_index):
            stuck = len(self.by_index) - self.metrics.completed
            raise SimulationError(
                f"{stuck} requests never completed (pool {len(self.policy)}, "
                f"running {[len(d.running) for d in self.decoders]})"
            )

    # --- prefill ------------------------------------------------------------------------------------

    def _start_prefills(self, now: float) -> None:
        for worker, busy in enumerate(self.prefill_busy):
            if busy is not None or not self.prefill_queue:
                continue
            chunk = [self.prefill_queue.popleft()]
            tokens = chunk[0].input_len
            while (
                self.prefill_queue
                and tokens + self.prefill_queue[0].input_len <= self.config.max_prefill_tokens
            ):
                tokens += self.prefill_queue[0].input_len
                chunk.append(self.prefill_queue.popleft())
            self.prefill_busy[worker] = chunk
            work = self.cost.prefill_s([r.input_len for r in chunk])
            self._retime(self.compute.start((_PREFILL, worker), work, now))

    def _prefill_done(self, now: float, worker: int, version: int) -> None:
        if version != self.prefill_version[worker]:
            return  # re-timed: a later event ends this pass
        chunk = self.prefill_busy[worker]
        assert chunk is not None
        self.prefill_busy[worker] = None
        self._retime(self.compute.finish((_PREFILL, worker), now))
        link = self.prefill_links[worker]
        for r in chunk:
            r.first_token_at = now
            if r.remaining == 0:
                self._complete(r, now)
                continue
            landed = link.send(now, self.cost.transfer_s(r.blocks, Link.PCIE))
            self._push(landed, _KV_READY, r.index)
        self._start_prefills(now)

    # --- KV pool and batcher -------------------------------------------------------------------------

    def _kv_ready(self, now: float, index: int, _: int) -> None:
        r = self.by_index[index]
        r.pool_at = now
        self._into_pool(r)
        self.policy.add(r.waiting(now))
        self.waiting[r.request_id] = r
        self._want_tick(now)

    def _into_pool(self, r: SimRequest) -> None:
        r.in_pool = True
        self.metrics.pool_change(r.blocks)

    def _want_tick(self, now: float, delay: float = 0.0) -> None:
        when = now + delay
        if self.tick_at is not None and self.tick_at <= when:
            return
        self.tick_at = when
        self._push(when, _BATCH_TICK)

    def _batch_tick(self, now: float, _a: int, _b: int) -> None:
        if self.tick_at != now:
            return  # superseded by an earlier tick
        self.tick_at = None
        wanting = [d for d in self.decoders if not d.staging_batch]
        wanting.sort(key=lambda d: (not d.idle, d.index))  # idle workers first
        # the policy said "wait" for this effective K_min: same pool, same answer
        refused: set[int] = set()
        for worker in wanting:
            limits = load_adapted(self.limits, worker.room(), len(self.policy))
            if not len(self.policy) or limits.min_requests in refused:
                continue
            started = time.perf_counter()
            batch = self.policy.form_batch(limits, now)
            self.metrics.form_s.append(time.perf_counter() - started)
            if batch:
                self._stage(worker, batch, now, as_batch=True)
            else:
                refused.add(limits.min_requests)
        retry = self.config.batcher_retry_s
        if retry is not None and len(self.policy) and any(not d.staging_batch for d in self.decoders):
            self._want_tick(now, retry)

    def _stage(self, worker: DecodeWorker, chosen: list[WaitingRequest], now: float, as_batch: bool) -> None:
        """Move policy output into a worker's candidate buffer; with prefetch, copy it to the prefill GPU."""
        members = [self.waiting.pop(w.request_id) for w in chosen]
        if as_batch:
            batch_id = self.next_batch_id
            self.next_batch_id += 1
            worker.staging_batch = True
        else:
            found = worker.newest_batch_range()
            batch_id = found[0] if found else self.next_batch_id
        buffer = worker.candidate_batch if as_batch else worker.candidate_requests
        partner = self.prefill_links[worker.index % len(self.prefill_links)]
        for r in members:
            r.batch_id = batch_id
            # prefetch: request by request over the partner's PCIe link, each usable once it landed
            r.ready_at = (
                partner.send(now, self.cost.transfer_s(r.blocks, Link.PCIE)) if self.config.prefetch else now
            )
            buffer[r.request_id] = r
        self._wake(worker, min(r.ready_at for r in members))

    def _wake(self, worker: DecodeWorker, ready: float) -> None:
        """A candidate becomes ready at `ready`: make sure the worker reaches a boundary by then."""
        span = worker.span
        if span is None:
            self._wake_idle(worker, ready)
            return
        k = span.first_boundary_at_or_after(ready)
        if k < span.iterations:
            span.iterations = k
            worker.version += 1
            self._push(span.start + span.offset(k), _DECODE_BOUNDARY, worker.index, worker.version)

    def _wake_idle(self, worker: DecodeWorker, when: float) -> None:
        """A worker with nothing running gets a boundary at `when` unless one is due sooner."""
        if worker.wake_at is not None and worker.wake_at <= when:
            return
        worker.wake_at = when
        worker.version += 1
        self._push(when, _DECODE_BOUNDARY, worker.index, worker.version)

    # --- decode --------------------------------------------------------------------------------------

    def _decode_boundary(self, now: float, index: int, version: int) -> None:
        worker = self.decoders[index]
        if version != worker.version:
            return
        worker.wake_at = None
        finished: list[SimRequest] = []
        if worker.span is not None:
            self._retime(self.compute.finish((_DECODE, index), now))
            finished = worker.advance(worker.span, worker.span.iterations)
            worker.span = None
        state = worker.state(frozenset(r.request_id for r in finished), now)
        started = time.perf_counter()
        plan = self.planner(state)
        self.metrics.sched_s.append(time.perf_counter() - started)
        stall = self._apply(worker, state, plan, now)
        if plan.finished or plan.evicted:
            self._dynamic_prefetch(worker, now)
            if worker.room().free_slots > 0 and len(self.policy):
                self._want_tick(now)  # it has free slots: what waits may go out now (room.py)
        if not worker.candidate_batch and worker.staging_batch:
            worker.staging_batch = False  # the staged batch is all in: form the next one
            self._want_tick(now)
        if not worker.running:
            if worker.idle:
                self._want_tick(now)
            ready = worker.next_ready_after(now)
            if ready is not None:
                self._wake_idle(worker, ready)
            elif state.candidate_batch or state.candidate_requests:
                raise SimulationError(f"decode worker {index} is idle but its scheduler admitted nothing")
            return
        quiet = not (plan.finished or plan.evicted or plan.admitted)
        one_by_one = self.config.exact_iterations or self.compute.per_iteration
        iterations = 1 if one_by_one or not quiet else worker.quiet_iterations()
        kv_lens = [r.prefix + 1 for r in worker.running.values()]
        span = Span(now, stall, iterations, self.cost.decode_span(kv_lens), self.cost.decode_parts(kv_lens))
        worker.span = span
        ready = worker.next_ready_after(now)
        if ready is not None:
            span.iterations = min(span.iterations, span.first_boundary_at_or_after(ready))
        self._retime(self.compute.start((_DECODE, index), span.offset(span.iterations), now))

    def _retime(self, ends: Ends) -> None:
        """(Re)schedule the completion events of the jobs whose end the compute strategy set."""
        for (kind, index), when in ends:
            if kind == _PREFILL:
                self.prefill_version[index] += 1
                self._push(when, _PREFILL_DONE, index, self.prefill_version[index])
                continue
            worker = self.decoders[index]
            span = worker.span
            assert span is not None
            # sharing stretched (or shrank) the iteration: its end, and so its tokens' times, move
            span.stall_s += when - (span.start + span.offset(span.iterations))
            worker.version += 1
            self._push(when, _DECODE_BOUNDARY, index, worker.version)

    def _apply(self, worker: DecodeWorker, state: IterationState, plan: IterationPlan, now: float) -> float:
        """Carry out a plan; returns the KV-transfer stall before the next iteration."""
        if set(plan.finished) != state.finished:
            raise SimulationError(
                f"plan finished {sorted(plan.finished)} but {sorted(state.finished)} completed"
            )
        for request_id in plan.finished:
            self._complete(worker.leave(request_id), now)
        link = Link.NVLINK if self.config.prefetch else Link.PCIE
        moved = 0
        for request_id in plan.evicted:
            r = worker.leave(request_id)
            r.ready_at = now
            worker.candidate_requests[request_id] = r
            worker.stats.evictions += 1
            moved += r.blocks
            if not self.config.prefetch:
                self._into_pool(r)
        for request_id in plan.admitted:
            source = (
                worker.candidate_requests
                if request_id in worker.candidate_requests
                else worker.candidate_batch
            )
            candidate = source.get(request_id)
            if candidate is None or candidate.ready_at > now:
                raise SimulationError(f"plan admitted {request_id!r}, which is not a ready candidate")
            r = source.pop(request_id)
            if r.admitted_at < 0:
                r.admitted_at = now
                self.metrics.admitted(r, now)
            if r.in_pool:
                r.in_pool = False
                self.metrics.pool_change(-r.blocks)
            worker.join(r)
            moved += r.blocks
        if worker.used_blocks + worker.growth_blocks() > worker.capacity_blocks:
            raise SimulationError(
                f"decode worker {worker.index}: plan leaves {worker.free_blocks} free blocks, "
                f"next iteration needs {worker.growth_blocks()}"
            )
        if worker.max_batch is not None and len(worker.running) > worker.max_batch:
            raise SimulationError(f"decode worker {worker.index}: {len(worker.running)} running > max_batch")
        return self.cost.transfer_s(moved, link) if moved else 0.0

    def _dynamic_prefetch(self, worker: DecodeWorker, now: float) -> None:
        """Room just freed: pull waiting requests that fit the running batch's range (DESIGN.md §3)."""
        if not self.config.dynamic_prefetch or worker.candidate_requests or not len(self.policy):
            return
        found = worker.newest_batch_range()
        if found is None:
            return
        _, lo, hi = found
        hi += self.config.range_slack
        room = worker.free_blocks - len(worker.running)  # keep a block of growth for each runner
        slots = (worker.max_batch - len(worker.running)) if worker.max_batch is not None else len(self.policy)
        if room <= 0 or slots <= 0:
            return
        chosen = self.policy.prefetch_candidates(lo, hi, room, slots)
        if chosen:
            self._stage(worker, chosen, now, as_batch=False)
