"""The decode worker's loop at the I/O edge of `DecodeCore`: engine steps, KV moves, bus messages.

Per iteration: one engine decode step (in a thread, so heartbeats and the bus keep running), its tokens
published (one TokenBatch per gateway, RequestFinished for the finished), then `plan_iteration` on the
engine's running requests and the ready candidates: victims are exported and pushed to their staging
worker's candidate request buffer (the kvpool when there is none) and freed; admitted requests' KV is
taken from the local prefetcher (pre-pulled onto this device, or pulled now) and imported. Then a DecodeStatus for the batcher.
A request whose KV is lost here (a pull or import failed, no room at admission, nobody took it at
drain) is forgotten and reported with `RequestLost`: its gateway re-prefills it, the client loses nothing.

Only this loop touches the engine; bus handlers change the core, start KV pulls and wake the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from alignedserve.batching.scheduler import plan_iteration
from alignedserve.bus import Bus, Delivery, topics
from alignedserve.bus.messages import (
    BatchPlan,
    Cancel,
    CandidateBuffer,
    KvLocation,
    Message,
    PrefetchDone,
    RequestFinished,
    ServiceKind,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.core.blocks import OutOfBlocks
from alignedserve.decode.config import DecodeSettings
from alignedserve.decode.core import Candidate, DecodeCore, Publish, RunningProfile
from alignedserve.decode.gateways import GatewayWatch
from alignedserve.decode.kv_io import KvMover, LocalPrefetcher, StagedKv
from alignedserve.decode.metrics import DecodeMetrics
from alignedserve.decode.publisher import OrderedPublisher
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_envelope import EnvelopeError, KvEnvelope
from alignedserve.engine.kv_export import KvExport, KvFormatError
from alignedserve.engine.request import RequestError, RequestOutput
from alignedserve.service.compute_turns import compute_turns
from alignedserve.service.drain import Drain
from alignedserve.service.engine_thread import EngineThread
from alignedserve.service.logs import get_logger, request_context
from alignedserve.service.sampling import to_params
from alignedserve.transfer import TransferEndpoint, TransferError
from alignedserve.transfer.memory import TorchMemory

log = get_logger("alignedserve.decode")

DRAIN_DECODE_SHARE = 0.7  # of drain_timeout_s spent finishing running requests; the rest hands them back
PUBLISH_FLUSH_S = 5.0  # at exit, how long queued messages may take to reach the broker
KV_ERRORS = (KvFormatError, EnvelopeError)  # the KV itself is unusable: lost, re-prefilled
REFUSED_ERRORS = (RequestError, ValueError)  # the request can never run (too long, bad sampling): failed


class DecodeWorker:
    def __init__(
        self,
        settings: DecodeSettings,
        engine: LLMEngine,
        bus: Bus,
        endpoint: TransferEndpoint,
        metrics: DecodeMetrics,
        drain: Drain,
        engine_thread: EngineThread | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.engine_thread = engine_thread or EngineThread()  # the thread the engine was placed on
        self.turns = compute_turns(settings.prefill_first_lock, settings.prefill_first_max_wait_ms)
        self.bus = bus
        self.metrics = metrics
        self.drain = drain
        block_size = engine.allocator.block_size
        # seq must keep increasing across a restart (the batcher ignores older reports): start from ms
        self.core = DecodeCore(settings.worker_id, block_size, settings.max_num_seqs, int(time.time() * 1000))
        self.mover = KvMover(endpoint, TorchMemory(settings.device))  # KV lands on the decode device
        self.prefetcher = LocalPrefetcher(
            self.mover,
            int(settings.local_prefetch_bytes),
            engine.layout.bytes_per_block // block_size,
            self._count_pulled,
            from_pool=settings.prefetch_from_pool,
        )
        self.publisher = OrderedPublisher(bus, metrics.publish_seconds.observe)
        self.pools: dict[str, KvLocation] = {}  # kvpool worker id -> where its endpoint is
        self.gateways = GatewayWatch(settings.worker_timeout_s)
        self.iteration = 0
        self._wake = asyncio.Event()
        self._last_status = 0.0

    # --- bus handlers (no engine calls here: the loop may be inside a step) ---------------------------

    async def on_decode_topic(self, message: Message, _delivery: Delivery) -> None:
        if isinstance(message, BatchPlan):
            self._publish(self.core.on_plan(message))  # RequestLost of an overtaking failed PrefetchDone
            for planned in message.requests:
                self._learn_pool(planned.location)
                with request_context(planned.request_id, planned.state.client_request_id):
                    log.info("candidate_planned", batch_id=message.batch_id, buffer=message.buffer.value)
            log.info("plan_received", batch_id=message.batch_id, buffer=message.buffer.value,
                     size=len(message.requests), staging=message.staging_worker_id)  # fmt: skip
        elif isinstance(message, PrefetchDone):
            lost = self.core.on_prefetch_done(message)
            if lost:
                log.warning("prefetch_failed", batch_id=message.batch_id, lost=len(lost),
                            staging=message.staging_worker_id)  # fmt: skip
            self._publish(lost)
        # Pull the new candidates' KV now, during the step in flight: the loop's own fill comes after the
        # next iteration's admissions, so a candidate admitted there would be pulled with the engine idle.
        self.prefetcher.fill(self.core.candidates())
        self._wake.set()

    async def on_event(self, message: Message) -> None:
        if isinstance(message, Cancel) or (
            isinstance(message, RequestFinished) and message.worker_id != self.core.worker_id
        ):
            with request_context(message.request_id):
                self.core.on_gone(message.request_id)
                self.prefetcher.discard(message.request_id)
            self._wake.set()
        elif isinstance(message, WorkerHeartbeat) and message.kind is ServiceKind.KVPOOL:
            if message.state in (WorkerState.READY, WorkerState.STARTING) and message.ucx_address:
                address = message.ucx_address.decode()
                self._learn_pool(KvLocation(worker_id=message.worker_id, kind=ServiceKind.KVPOOL,
                                            ucx_address_key=address))  # fmt: skip
            else:
                self.pools.pop(message.worker_id, None)
        elif isinstance(message, WorkerHeartbeat) and self.gateways.heard(message, time.monotonic()):
            how = "stopped" if message.state is WorkerState.STOPPED else "restarted"
            self._orphan({message.worker_id}, f"gateway {message.worker_id} {how}")

    # --- the loop -------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Iterate until drain begins, then finish or hand back the work (counted as in-flight work)."""
        self.drain.enter()
        publishing = asyncio.create_task(self.publisher.run(), name="decode-publisher")
        try:
            while not self.drain.draining:
                await self.tick()
            await self.drain_out()
        finally:
            await self.prefetcher.close()
            await self.publisher.flush(PUBLISH_FLUSH_S)
            publishing.cancel()
            self.drain.leave()

    async def tick(self) -> None:
        silent = self.gateways.silent(time.monotonic())
        if silent:
            self._orphan(silent, "gateway silent")
        ran, scheduling_s = await self._iterate()
        started = time.perf_counter()
        running = self.engine.running_requests()
        plan = plan_iteration(self.core.iteration_state(running, self.engine.num_free_blocks()))
        scheduling_s += time.perf_counter() - started
        if plan.evicted:
            await self._evict(plan.evicted)
        if plan.admitted:
            await self._admit(plan.admitted, plan.admitted_from)
        self.prefetcher.fill(self.core.candidates())
        changed = bool(plan.evicted or plan.admitted)
        due = time.monotonic() - self._last_status >= self.settings.status_interval_s
        if ran or changed or due:
            started = time.perf_counter()
            self._publish_status()  # queued: the broker round trip overlaps the next forward
            scheduling_s += time.perf_counter() - started
        if ran:
            self.metrics.scheduling_seconds.observe(scheduling_s)
        self._update_gauges()
        if not ran and not changed:
            await self._idle_wait()

    async def drain_out(self) -> None:
        """Candidates go back to the batcher now; running requests get `DRAIN_DECODE_SHARE` of the drain
        timeout to finish, then their KV goes to the pool and the batcher takes them back."""
        log.info(
            "decode_draining", running=len(self.core.running_ids), candidates=len(self.core.candidates())
        )
        for candidate in self.core.candidates():
            await self._return_candidate(candidate)
        deadline = time.monotonic() + self.settings.drain_timeout_s * DRAIN_DECODE_SHARE
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            await self._iterate()
        for info in self.engine.running_requests():
            await self._evict_one(info.request_id, back_to_pool=True)
        for rid in self.core.running_ids:  # left the engine otherwise (e.g. preempted, waiting there)
            self.engine.free(rid)
            self._lose(rid, "decode worker stopped before the request finished")
        self._publish_status()

    # --- steps ----------------------------------------------------------------------------------------

    async def _iterate(self) -> tuple[bool, float]:
        """One engine step if there is work; returns (ran, seconds of scheduling and bus work)."""
        for rid in self.core.take_aborts():
            self.engine.abort(rid)
        if not self.engine.has_unfinished():
            return False, 0.0
        profile = self.core.profile(self.engine.running_requests())  # the set this step decodes
        waited, step_s, outputs = await self.engine_thread.call(self._step_in_turn)
        stepped = time.perf_counter()
        self.iteration += 1
        self.metrics.prefill_wait_seconds.inc(waited)
        self._observe_iteration(outputs, step_s, profile)
        self._publish(self.core.on_outputs(outputs, self.iteration))
        for rid in self.core.take_aborts():  # cancelled while the step ran
            self.engine.abort(rid)
        return True, time.perf_counter() - stepped

    def _step_in_turn(self) -> tuple[float, float, list[RequestOutput]]:
        """(seconds waited for prefill forwards, seconds the step took, its outputs). Engine thread."""
        with self.turns.decode_step() as waited:
            started = time.perf_counter()
            outputs = self.engine.step()
            return waited, time.perf_counter() - started, outputs

    def _observe_iteration(
        self, outputs: Sequence[RequestOutput], step_s: float, profile: RunningProfile
    ) -> None:
        self.metrics.iteration_seconds.observe(step_s)
        self.metrics.iterations.inc()
        self.metrics.generation_tokens.inc(sum(len(o.new_token_ids) for o in outputs))
        for output in outputs:
            if output.finished:
                self.metrics.finished.labels(output.finish_reason or "stop").inc()
                with request_context(output.request_id, self._label(output.request_id)):
                    log.info("request_finished", reason=output.finish_reason or "stop",
                             output_tokens=len(output.output_token_ids))  # fmt: skip
        self.metrics.prefix_spread.observe(profile.spread)
        if profile.batches > 1:
            self.metrics.mixed_iterations.inc()

    async def _evict(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            await self._evict_one(rid, back_to_pool=False)

    async def _evict_one(self, rid: str, back_to_pool: bool) -> None:
        """Export and push the request's KV, then free it here. When no one takes the KV it stays in the
        engine (whose own scheduler recomputes it if blocks run short) or, when draining, it fails."""
        with request_context(rid, self._label(rid)):
            log.info("request_evicting", back_to_pool=back_to_pool)
            await self._evict_kv(rid, back_to_pool)

    async def _evict_kv(self, rid: str, back_to_pool: bool) -> None:
        kv = self.engine.export_kv(rid)
        prompt, output = self.engine.token_ids(rid)
        envelope = KvEnvelope(kv.header, tuple(prompt), tuple(output))
        target = None if back_to_pool else self.core.eviction_target(rid)
        location = await self._push(rid, envelope, kv, target)
        if location is None:
            if back_to_pool:
                self.engine.free(rid)
                self._lose(rid, "decode worker drained and no kvpool took the KV")
            return
        self.engine.free(rid)
        to = None if back_to_pool else CandidateBuffer.REQUESTS
        self.metrics.evicted.labels("pool" if to is None else location.kind.value).inc()
        self._publish(self.core.evicted(rid, kv.header.num_tokens, output, location, to))

    async def _push(
        self, rid: str, envelope: KvEnvelope, kv: KvExport, target: KvLocation | None
    ) -> KvLocation | None:
        """Push to `target`, else to a kvpool; returns where the KV went (None: nobody took it)."""
        for location in [*([target] if target is not None else []), *self._pool_order()]:
            try:
                await self.mover.push(location, rid, envelope, kv)
                return location
            except TransferError as exc:
                log.warning("kv_push_failed", request_id=rid, to=location.worker_id, error=str(exc))
        return None

    async def _admit(self, request_ids: Sequence[str], source: str) -> None:
        """Take the admitted candidates' KV (all pulls at once) and import it; the loop waits meanwhile."""
        started = time.perf_counter()
        candidates = [c for rid in request_ids if (c := self.core.candidate(rid)) is not None and c.ready]
        results = await asyncio.gather(*(self.prefetcher.take(c) for c in candidates), return_exceptions=True)
        for candidate, result in zip(candidates, results, strict=True):
            await self._import(candidate, result, source)
        self.metrics.admission_stall_seconds.observe(time.perf_counter() - started)

    async def _import(self, candidate: Candidate, result: StagedKv | BaseException, source: str) -> None:
        with request_context(candidate.request_id, candidate.state.client_request_id):
            await self._import_kv(candidate, result, source)

    async def _import_kv(self, candidate: Candidate, result: StagedKv | BaseException, source: str) -> None:
        rid = candidate.request_id
        if self.core.candidate(rid) is None:
            return  # cancelled while its KV was on the way
        if isinstance(result, BaseException):
            if not isinstance(result, TransferError | EnvelopeError):
                raise result
            log.warning("kv_pull_failed", request_id=rid, error=str(result))
            self._lose(rid, f"KV pull failed: {result}")
            return
        envelope = result.envelope
        try:
            self.engine.import_request(
                rid,
                result.export(),
                list(envelope.prompt_token_ids),
                list(envelope.output_token_ids),
                to_params(candidate.state.sampling),
                verified=True,  # the pull checked the payload's checksum on arrival
            )
        except OutOfBlocks:
            log.warning("admission_without_room", request_id=rid)  # its pulled KV has nowhere to go
            self._lose(rid, "no KV room at admission")
            return
        except KV_ERRORS as exc:
            log.warning("kv_import_failed", request_id=rid, error=str(exc))
            self._lose(rid, f"KV import failed: {exc}")
            return
        except REFUSED_ERRORS as exc:
            log.warning("request_refused", request_id=rid, error=str(exc))
            self._publish(self.core.fail(rid, f"request refused: {exc}"))
            return
        self.core.admitted(rid)
        self.metrics.admitted.labels(source or "requests").inc()
        prefix_len = len(envelope.prompt_token_ids) + len(envelope.output_token_ids)
        log.info("request_admitted", source=source or "requests", prefix_len=prefix_len)

    async def _return_candidate(self, candidate: Candidate) -> None:
        """Draining: hand a candidate back to the batcher, its KV where it is (pushed to the pool first
        when this worker already pulled it)."""
        location = candidate.location or candidate.source
        if self.prefetcher.holds(candidate.request_id):
            try:
                staged = await self.prefetcher.take(candidate)
            except (TransferError, EnvelopeError) as exc:
                self._lose(candidate.request_id, f"KV pull failed: {exc}")
                return
            pushed = await self._push(candidate.request_id, staged.envelope, staged.export(), None)
            if pushed is None:
                self._lose(candidate.request_id, "no kvpool took the KV at drain")
                return
            location = pushed
        self._publish(self.core.returned(candidate.request_id, location))

    # --- bus and bookkeeping --------------------------------------------------------------------------

    def _label(self, rid: str) -> str:
        """The client's X-Request-Id of a running request (for its log lines); "" when unknown."""
        state = self.core.state_of(rid)
        return state.client_request_id if state is not None else ""

    def _publish(self, messages: Sequence[Publish]) -> None:
        self.publisher.submit(messages)

    def _lose(self, rid: str, reason: str) -> None:
        """Forget a request whose KV is gone; its gateway re-prefills it (`RequestLost`)."""
        with request_context(rid, self._label(rid)):
            log.warning("request_lost", reason=reason)
        self.prefetcher.discard(rid)
        self._publish(self.core.lose(rid, reason))

    def _orphan(self, gateway_ids: set[str], reason: str) -> None:
        """Cancel the requests of gateways that are gone (gateways.py): the engine aborts the running
        ones before its next step, every other service frees its copies when it reads the Cancel."""
        cancels = self.core.orphan(gateway_ids, reason)
        for cancel in cancels:
            with request_context(cancel.request_id):
                log.warning("request_orphaned", reason=reason)
            self.prefetcher.discard(cancel.request_id)
        self.metrics.orphaned.inc(len(cancels))
        self._publish([(topics.EVENTS, cancel) for cancel in cancels])
        self._wake.set()

    def _publish_status(self) -> None:
        running = self.engine.running_requests()
        status = self.core.status(self.engine.num_free_blocks(), self.engine.allocator.num_blocks, running)
        self.publisher.submit([(topics.BATCHER, status)])
        self._last_status = time.monotonic()

    async def _idle_wait(self) -> None:
        timeout = max(0.0, self._last_status + self.settings.status_interval_s - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        self._wake.clear()

    def _update_gauges(self) -> None:
        allocator = self.engine.allocator
        self.metrics.kv_usage.set(allocator.num_used / allocator.num_blocks)
        self.metrics.running.set(len(self.core.running_ids))
        requests, batch = self.core.candidate_counts
        self.metrics.candidates.labels(CandidateBuffer.REQUESTS.value).set(requests)
        self.metrics.candidates.labels(CandidateBuffer.BATCH.value).set(batch)
        self.metrics.local_prefetch_bytes.set(self.prefetcher.used_bytes)

    def _count_pulled(self, nbytes: int, ahead: bool) -> None:
        self.metrics.pulled_bytes.labels("prefetch" if ahead else "admission").inc(nbytes)

    def _learn_pool(self, location: KvLocation) -> None:
        if location.kind is ServiceKind.KVPOOL and location.ucx_address_key:
            self.pools[location.worker_id] = location

    def _pool_order(self) -> list[KvLocation]:
        return [self.pools[w] for w in sorted(self.pools)]
