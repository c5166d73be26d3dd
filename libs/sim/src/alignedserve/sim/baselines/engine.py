"""Event loop of the baseline systems: instances that step by their own scheduler, on the same cost model
and the same workload, arrival processes and metrics as the aligned simulator (`cluster.py`).

- Co-located (vLLM, FastGen): every instance prefills and decodes; arrivals go round-robin (the load
  balancer of DistServe's and vLLM's evaluations). A pass is what the instance's `StepScheduler` plans.
- Disaggregated (DistServe): prefill instances run FCFS context batches and keep the KV until decode
  instance `p mod D` accepts the request (its KV then moves over NVLink, the decoder waiting for it).

Decode-only passes of an unchanged batch run as spans (closed-form durations, `decode.Span`), cut at the
next boundary when a request arrives; `exact_iterations` plans every pass (the tests compare the two).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from alignedserve.core.blocks import blocks_for
from alignedserve.core.workloads.arrivals import OPEN_LOOP, ArrivalProcess
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.sim.baselines.distserve import CONTEXT_MAX_BATCH, context_batch
from alignedserve.sim.baselines.replica import Replica
from alignedserve.sim.baselines.steps import StepPlan, StepScheduler
from alignedserve.sim.cost import CostModel, Link
from alignedserve.sim.decode import Span
from alignedserve.sim.events import EventQueue
from alignedserve.sim.iterstats import arrival_mark
from alignedserve.sim.metrics import Metrics
from alignedserve.sim.records import SimRequest, SimulationError

_PREFILL_DONE, _STEP = 0, 1


@dataclass(frozen=True, slots=True)
class BaselineConfig:
    scheduler: StepScheduler  # stateless: shared by every instance
    replicas: int  # instances that decode (co-located replicas, or a disaggregated system's decoders)
    prefill_instances: int = 0  # a disaggregated system's prefill instances; 0: co-located
    arrivals: ArrivalProcess = OPEN_LOOP
    exact_iterations: bool = False  # plan every pass (no spans): for checking


class PrefillInstance:
    """A DistServe context-stage GPU: FCFS batches, KV kept until the decoder accepts the request."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.queue: deque[SimRequest] = deque()
        self.batch: list[SimRequest] | None = None
        self.held_blocks = 0  # KV of the batch in flight and of prefilled requests not yet accepted


class BaselineCluster:
    """One simulation run of a baseline system. `run()` returns the metrics; used once."""

    def __init__(self, specs: Sequence[RequestSpec], cost: CostModel, config: BaselineConfig) -> None:
        if config.replicas < 1 or config.prefill_instances < 0:
            raise ValueError("need at least one decoding instance")
        self.cost, self.config = cost, config
        bs, capacity = cost.block_size, cost.decode_capacity_blocks
        self.colocated = config.prefill_instances == 0
        self.by_index = [
            SimRequest(i, s.arrival_s, s.input_len, s.output_len, bs) for i, s in enumerate(specs)
        ]
        too_long = [r for r in self.by_index if r.final_len > capacity * bs]
        if too_long:
            raise ValueError(
                f"{len(too_long)} requests need more KV than an instance holds ({capacity * bs} tokens), "
                f"e.g. {too_long[0].input_len}+{too_long[0].output_len} tokens"
            )
        self.replicas = [Replica(i, capacity, bs, config.scheduler) for i in range(config.replicas)]
        self.prefills = [PrefillInstance(i) for i in range(config.prefill_instances)]
        self.home: dict[str, PrefillInstance] = {}  # prefilled, not yet accepted: where its KV is
        self.kicks: set[int] = set()  # replicas with a start-of-pass event pending
        self.arrivals = config.arrivals.start(self.by_index)
        self.queue = EventQueue()
        self._push = self.queue.push
        self.next_target = 0  # round-robin
        self.arrived = 0
        self.metrics = Metrics(len(self.by_index), bs * cost.kv_bytes_per_token)

    def run(self) -> Metrics:
        wall = time.perf_counter()
        self.queue.drain(self.arrivals, self._arrive, (self._prefill_done, self._step))
        if self.metrics.completed != len(self.by_index):
            stuck = len(self.by_index) - self.metrics.completed
            raise SimulationError(f"{stuck} requests never completed")
        self.metrics.finish([r.stats for r in self.replicas], time.perf_counter() - wall)
        return self.metrics

    def _arrive(self, r: SimRequest) -> None:
        now = r.arrival
        self.arrived += 1
        mark = arrival_mark(self.arrived, len(self.by_index))
        if mark is not None:
            for rep in self.replicas:
                rep.stats.marks[mark] = now
        target = self.next_target
        self.next_target += 1
        if self.colocated:
            rep = self.replicas[target % len(self.replicas)]
            r.prefix, r.pool_at = 0, now  # the replica computes its prompt; "wait" = queueing before it
            rep.waiting.append(r)
            self._poke(rep, now)
        else:
            p = self.prefills[target % len(self.prefills)]
            p.queue.append(r)
            self._start_prefill(p, now)

    def _complete(self, r: SimRequest, now: float) -> None:
        self.metrics.complete(r)
        self.arrivals.completed(now)

    # --- a disaggregated system's prefill instances -----------------------------------------------

    def _start_prefill(self, p: PrefillInstance, now: float) -> None:
        if p.batch is not None or not p.queue:
            return
        bs = self.cost.block_size
        free = self.cost.decode_capacity_blocks - p.held_blocks
        n = context_batch([r.input_len for r in islice(p.queue, CONTEXT_MAX_BATCH)], free, bs)
        if n == 0:
            return  # its GPU is full of KV the decoder has not taken yet
        p.batch = [p.queue.popleft() for _ in range(n)]
        p.held_blocks += sum(blocks_for(r.input_len, bs) for r in p.batch)
        self._push(now + self.cost.prefill_s([r.input_len for r in p.batch]), _PREFILL_DONE, p.index)

    def _prefill_done(self, now: float, index: int, _: int) -> None:
        p = self.prefills[index]
        batch, p.batch = p.batch or [], None
        decoder = self.replicas[index % len(self.replicas)]
        for r in batch:
            r.first_token_at = now
            if r.remaining == 0:
                p.held_blocks -= blocks_for(r.input_len, self.cost.block_size)
                self._complete(r, now)
                continue
            r.pool_at = now
            self.home[r.request_id] = p
            decoder.waiting.append(r)
        self._poke(decoder, now)
        self._start_prefill(p, now)

    # --- instances that decode --------------------------------------------------------------------

    def _poke(self, rep: Replica, now: float) -> None:
        """Work arrived for `rep`: start a pass (after the other arrivals of this instant) or cut its span."""
        span = rep.span
        if span is not None:
            k = span.first_boundary_at_or_after(now)
            if k < span.iterations:
                span.iterations = k
                rep.version += 1
                self._push(span.start + span.offset(k), _STEP, rep.index, rep.version)
        elif rep.current is None and rep.index not in self.kicks:
            self.kicks.add(rep.index)
            rep.version += 1
            self._push(now, _STEP, rep.index, rep.version)

    def _step(self, now: float, index: int, version: int) -> None:
        rep = self.replicas[index]
        if version != rep.version:
            return
        self.kicks.discard(index)
        finished: list[SimRequest] = []
        if rep.span is not None:
            finished = rep.end_span(rep.span)
            rep.span = None
        elif rep.current is not None:
            finished = rep.end_pass(rep.current)
            rep.current = None
        for r in finished:
            rep.leave(r)
            self._complete(r, now)
        self._start_pass(rep, now)

    def _plan(self, rep: Replica) -> StepPlan | None:
        """The next pass's plan, preemptions applied; None when there is nothing to run."""
        for _ in range(2):  # a plan that only preempts (FastGen's reset) is followed by a fresh one
            started = time.perf_counter()
            plan = rep.scheduler.plan(rep.view())
            self.metrics.sched_s.append(time.perf_counter() - started)
            for request_id in plan.preempted:
                rep.preempt(request_id)
            if plan.decode or plan.chunks:
                return plan
            if not plan.preempted:
                return None
        raise SimulationError(f"instance {rep.index}: its scheduler preempted everything and ran nothing")

    def _start_pass(self, rep: Replica, now: float) -> None:
        plan = self._plan(rep)
        if plan is None:
            return
        stall = self._accept(rep, list(plan.admitted), now)
        quiet = not (plan.chunks or plan.preempted or plan.admitted) and len(plan.decode) == len(rep.running)
        cost = self.cost
        if quiet and not self.config.exact_iterations:
            kv_lens = [r.prefix + 1 for r in rep.running.values()]
            rep.span = Span(
                now, stall, rep.quiet_iterations(), cost.decode_span(kv_lens), cost.decode_parts(kv_lens)
            )
            self._push(now + rep.span.offset(rep.span.iterations), _STEP, rep.index, rep.version)
            return
        p = rep.single_pass(plan, 0.0)
        for r, _ in p.chunks:
            if r.admitted_at < 0:
                r.admitted_at = now
                self.metrics.admitted(r, now)
        kv_lens = [r.prefix + 1 for r in p.decode]
        duration = cost.step_s(kv_lens, [(r.prefix, n) for r, n in p.chunks])
        if kv_lens:
            rep.stats.add_pass(duration, cost.decode_iteration_s(kv_lens), cost.decode_parts(kv_lens), stall)
        else:
            rep.stats.prefill_only_s += duration
            rep.stats.stall_s += stall
        p.end = now + stall + duration
        rep.current = p
        self._push(p.end, _STEP, rep.index, rep.version)

    def _accept(self, rep: Replica, ids: list[str], now: float) -> float:
        """A decoder takes prefilled requests: their KV moves from the prefill GPU; returns the stall."""
        if not ids:
            return 0.0
        moved = 0
        for r in rep.take_waiting(ids):
            moved += blocks_for(r.prefix, self.cost.block_size)
            r.admitted_at = now
            self.metrics.admitted(r, now)
            p = self.home.pop(r.request_id)
            p.held_blocks -= blocks_for(r.prefix, self.cost.block_size)
            self._start_prefill(p, now)
        return self.cost.transfer_s(moved, Link.NVLINK)
