"""`alignedserve batcher`: the pool's index and batch formation, at the edge of `BatcherCore`.

Reads the batcher topic (KvReady, DecodeStatus, RequestEvicted back to the pool) and the events topic
(Cancel, RequestFinished, heartbeats of prefill workers to stage on); publishes each BatchPlan to its
staging prefill worker (prefetch on) and, as a notice, to its decode worker.

Each plan also goes on the batcher topic itself, first: the kvpool reads it there and stops offering
those requests (it re-announces the unplanned ones when a batcher restarts; this batcher ignores it).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from alignedserve.batcher.config import BatcherSettings
from alignedserve.batcher.core import BatcherCore, BatcherRules
from alignedserve.batcher.metrics import BatcherMetrics
from alignedserve.batching.policies import make_policy
from alignedserve.bus import Delivery, topics
from alignedserve.bus.messages import (
    BatchPlan,
    Cancel,
    DecodeStatus,
    KvReady,
    Message,
    RequestEvicted,
    RequestFinished,
    ServiceKind,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.core.liveness import Liveness
from alignedserve.service.entry import run_service
from alignedserve.service.logs import get_logger, request_context
from alignedserve.service.worker import WorkerRuntime

log = get_logger("alignedserve.batcher")


def build_core(settings: BatcherSettings) -> BatcherCore:
    policy = make_policy(
        settings.policy,
        max_len=settings.max_len,
        leaf_width=settings.block_size,
        starvation_s=settings.starvation_s,
    )
    rules = BatcherRules(
        min_batch=settings.min_batch,
        max_batch=settings.max_batch,
        fill=settings.fill,
        prefetch=settings.prefetch == "on",
        dynamic_prefetch=settings.dynamic_prefetch,
        range_slack=settings.range_slack,
    )
    # batch ids must keep increasing across a restart: start from the clock (ms)
    return BatcherCore(policy, rules, first_batch_id=int(time.time() * 1000))


class Batcher:
    def __init__(self, settings: BatcherSettings, runtime: WorkerRuntime, metrics: BatcherMetrics) -> None:
        self.settings = settings
        self.runtime = runtime
        self.metrics = metrics
        self.core = build_core(settings)
        # prefill workers to stage on, decode workers to plan for (heard at time.monotonic())
        self.workers: Liveness[ServiceKind] = Liveness()

    async def on_batcher_topic(self, message: Message, _delivery: Delivery) -> None:
        started = time.perf_counter()
        now = time.time()
        if isinstance(message, KvReady):
            self._refresh_staging()  # plans go to live workers only
            with request_context(message.request_id, message.state.client_request_id):
                log.info("request_waiting", prefix_len=message.prefix_len, blocks=message.blocks)
            plans = self.core.on_kv_ready(message, now)
        elif isinstance(message, DecodeStatus):
            self._refresh_staging()
            plans = self.core.on_status(message, now)
        elif isinstance(message, RequestEvicted) and message.to is None:
            self._refresh_staging()
            with request_context(message.request_id, message.state.client_request_id):
                log.info("request_back_to_pool", prefix_len=message.prefix_len, blocks=message.blocks)
            plans = self.core.on_evicted_to_pool(message, now)
        else:
            return  # PrefetchDone, CandidateBufferState: the decode worker's status already reflects them;
            # BatchPlan: our own, for the kvpool
        self.metrics.decide_seconds.observe(time.perf_counter() - started)
        self.metrics.waiting.set(self.core.waiting)
        await self._publish(plans)

    async def on_event(self, message: Message) -> None:
        if isinstance(message, Cancel | RequestFinished):
            with request_context(message.request_id):
                self.core.on_request_gone(message.request_id)
        elif isinstance(message, WorkerHeartbeat):
            self._on_heartbeat(message)

    def _on_heartbeat(self, beat: WorkerHeartbeat) -> None:
        if beat.kind is ServiceKind.DECODE and beat.state in (WorkerState.DRAINING, WorkerState.STOPPED):
            self.workers.forget(beat.worker_id)  # planned for no more, from now on
            self.core.forget_worker(beat.worker_id)
        elif beat.kind in (ServiceKind.PREFILL, ServiceKind.DECODE):
            self.workers.heard(beat, time.monotonic())
        if beat.kind is ServiceKind.PREFILL:
            self._refresh_staging()

    def _refresh_staging(self) -> None:
        now, timeout_s = time.monotonic(), self.settings.worker_timeout_s
        self.core.set_staging_workers(self.workers.live(ServiceKind.PREFILL, now, timeout_s))
        for worker_id in self.workers.silent(now, timeout_s, ServiceKind.DECODE):
            # killed without a STOPPED beat: plan nothing more for it (its gateway moves its requests)
            log.warning("decode_worker_silent", worker_id=worker_id)
            self.workers.forget(worker_id)
            self.core.forget_worker(worker_id)

    async def _publish(self, plans: list[BatchPlan]) -> None:
        for plan in plans:
            lengths = [r.prefix_len for r in plan.requests]
            self.metrics.plans.labels(plan.buffer.value).inc()
            self.metrics.planned_requests.labels(plan.buffer.value).inc(len(plan.requests))
            self.metrics.batch_spread.observe(max(lengths) - min(lengths))
            log.info(
                "batch_planned",
                batch_id=plan.batch_id,
                decode=plan.decode_worker_id,
                staging=plan.staging_worker_id,
                buffer=plan.buffer.value,
                size=len(plan.requests),
                prefix_lo=min(lengths),
                prefix_hi=max(lengths),
            )
            _log_members(plan)
            # The kvpool's copy first: were it sent last, a crash just before it would let the pool offer
            # these requests to the next batcher while their plan is out (two plans, one pull fails).
            await self.runtime.bus.publish(topics.BATCHER, plan)
            if plan.staging_worker_id:
                await self.runtime.bus.publish(topics.staging(plan.staging_worker_id), plan)
            await self.runtime.bus.publish(topics.decode(plan.decode_worker_id), plan)


def _log_members(plan: BatchPlan) -> None:
    """One line per planned request, under its own id: the plan line above names none of them."""
    for member in plan.requests:
        with request_context(member.request_id, member.state.client_request_id):
            log.info("request_planned", batch_id=plan.batch_id, decode=plan.decode_worker_id,
                     prefix_len=member.prefix_len)  # fmt: skip


async def serve(settings: BatcherSettings) -> int:
    registry = CollectorRegistry()
    runtime = WorkerRuntime(ServiceKind.BATCHER, settings, registry)
    batcher = Batcher(settings, runtime, BatcherMetrics(registry))
    await runtime.start()
    try:
        await runtime.subscribe_events(batcher.on_event)
        await runtime.subscribe(topics.BATCHER, topics.BATCHER_GROUP, batcher.on_batcher_topic)
        runtime.set_ready()
        log.info("batcher_ready", policy=settings.policy, prefetch=settings.prefetch)
        await runtime.run_until_drained()
    finally:
        await runtime.close()
    return 0


def main(argv: list[str]) -> int:
    return run_service(BatcherSettings, serve, argv, __doc__)
