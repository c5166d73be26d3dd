"""The prefill worker's loop at the I/O edge of `PrefillCore`: bus messages, engine calls, KV moves.

1. Prompts (PREFILL topic, group `prefill`) queue here, read off the bus only while the worker has room
   (`PrefillCore.has_room`: what it leaves there, the group's other prefill workers take; an idle-intake
   worker polls, one prompt at a time); one loop moves them into the engine as KV
   blocks allow and runs one prefill forward at a time (a chunk of every prompt it holds, within
   `max_prefill_tokens`, shortest first by default). A prompt whose first token comes out of a forward
   is done at once, whatever else is still prefilling: its first token goes to its gateway, its KV to
   the kvpool (UCX push; *pool full* → back off and retry, taking no new prompts), then it is announced
   to the batcher (`KvReady`) and its blocks are freed. One forward's hand-offs run while the next
   forward computes (waiting for the push's round trip left the engine idle); the forward after that
   waits for them, so at most one forward's KV waits for a full pool.
2. Staging (its `stage` topic): for a `BatchPlan` it pulls each request's KV from where it is into its
   candidate buffers and tells the decode worker (`PrefetchDone`); decode workers pull from there, and
   push evicted requests' KV into its candidate request buffer.
The decisions are the core's (core.py), the UCX side is kv_io.py; the engine runs in a thread, so the
bus and the heartbeat keep going during a forward pass.
"""

from __future__ import annotations

import asyncio
import time

from alignedserve.bus import BusUnavailable, ConsumerOptions, Delivery
from alignedserve.bus.messages import (
    BatchPlan,
    Cancel,
    KvLocation,
    Message,
    PlannedRequest,
    PrefillRequest,
    RequestFinished,
    WorkerHeartbeat,
)
from alignedserve.core.retry import Backoff, retrying
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_envelope import KvEnvelope
from alignedserve.engine.kv_export import KvExport
from alignedserve.engine.request import RequestError, RequestOutput
from alignedserve.prefill.config import PrefillSettings
from alignedserve.prefill.core import Intake, PrefillCore, Prefilled, Publish, Stage, hand_back
from alignedserve.prefill.kv_io import PrefillKv
from alignedserve.prefill.metrics import PrefillMetrics
from alignedserve.service.compute_turns import compute_turns
from alignedserve.service.engine_thread import EngineThread
from alignedserve.service.logs import get_logger, request_context
from alignedserve.service.sampling import to_params
from alignedserve.service.worker import WorkerRuntime
from alignedserve.transfer import PushRejected, TransferEndpoint, TransferError
from alignedserve.transfer.kv_store import StoreSink

log = get_logger("alignedserve.prefill")
POOL_RETRY_MAX_S = 2.0
POOL_WAIT_S = 0.05  # poll for a kvpool's address (its heartbeat carries it)
IDLE_INTAKE_POLL_S = 0.02  # an idle-intake worker asks the bus for a prompt this often while none comes


class PrefillWorker:
    def __init__(
        self,
        settings: PrefillSettings,
        runtime: WorkerRuntime,
        engine: LLMEngine,
        endpoint: TransferEndpoint,
        staging_sink: StoreSink,
        metrics: PrefillMetrics,
        engine_thread: EngineThread | None = None,
    ) -> None:
        self.settings = settings
        self.runtime = runtime
        self.engine = engine
        self.engine_thread = engine_thread or EngineThread()  # the thread the engine was placed on
        self.turns = compute_turns(settings.prefill_first_lock, settings.prefill_first_max_wait_ms)
        self.metrics = metrics
        self.core = PrefillCore(
            runtime.worker_id,
            settings.block_size,
            settings.max_prefill_tokens,
            settings.max_num_seqs,
            settings.max_queue,
            Intake(settings.max_backlog_tokens, settings.intake == "idle"),
            settings.queue_order(),
        )
        self.kv = PrefillKv(runtime.worker_id, endpoint, staging_sink)
        staging_sink.cancelled = self.core.ended  # a push of an ended request is not kept
        self._wake = asyncio.Event()
        self._room = asyncio.Event()  # set whenever the prompts held here may have shrunk
        self._holding_drain = False  # queued and prefilling prompts count as in-flight work
        self._prefilling: dict[str, PrefillRequest] = {}  # in the engine, by id, until their first token
        self._handing_off: asyncio.Task[None] | None = None  # the last forward's KV hand-offs

    async def _publish(self, messages: list[Publish]) -> None:
        for topic, message in messages:
            await self.runtime.bus.publish(topic, message)

    # --- prompts ---------------------------------------------------------------------------------------

    def prompt_intake(self) -> ConsumerOptions:
        """How the prompt subscription reads: only while this worker has room (`PrefillCore.has_room`),
        one prompt a read where a limit applies, and by polling for an idle-intake worker."""
        intake = self.core.intake
        if not intake.limited:
            return ConsumerOptions(room=self.room_for_prompt)
        poll_s = IDLE_INTAKE_POLL_S if intake.when_idle else None
        return ConsumerOptions(batch=1, room=self.room_for_prompt, poll_s=poll_s)

    async def room_for_prompt(self) -> None:
        """Until this worker takes another prompt: a full one leaves them to the other prefill workers."""
        while not self.core.has_room(self._prefilling.values()):
            self._room.clear()
            await self._room.wait()

    async def on_prompt(self, message: Message, _delivery: Delivery) -> None:
        if not isinstance(message, PrefillRequest) or not self.core.is_new(message):
            return  # ended, or re-published / redelivered: prefilled once only
        with request_context(message.request_id, message.client_request_id):
            log.info("prompt_received", prompt_tokens=len(message.prompt_token_ids))
            await self._take_prompt(message)

    async def _take_prompt(self, message: PrefillRequest) -> None:
        await self.room_for_prompt()  # a prompt read before the worker filled up waits here
        if self.runtime.drain.draining:  # acknowledged here, so hand it to another worker
            await self._publish([hand_back(message, time.time())])
            return
        self.core.take(message)
        self._hold_drain()
        self.metrics.queued.set(len(self.core.queue))
        self._wake.set()

    async def prefill_loop(self) -> None:
        while True:
            while not self.core.queue and not self._prefilling:
                self._release_drain()
                self._room.set()
                self._wake.clear()
                await self._wake.wait()
            if self.core.queue and self.runtime.drain.draining:  # not started: to the other workers
                await self._publish(self.core.hand_back_queue(time.time()))
                self.metrics.queued.set(0)
                log.info("prefill_queue_handed_back")
            elif self.core.queue:
                await self._admit(self.core.next_batch(time.time()))
                self.metrics.queued.set(len(self.core.queue))
                self._room.set()
            if self._prefilling:
                try:
                    await self._forward()
                except BusUnavailable as exc:  # its requests end at their gateway, which lost the bus too
                    log.warning("prefill_unpublished", error=str(exc))
            self._room.set()  # prompts were admitted or prefilled: the intake looks again

    def _hold_drain(self) -> None:
        """Queued prompts are acknowledged on the bus already: a drain waits until they are prefilled."""
        if not self._holding_drain:
            self._holding_drain = True
            self.runtime.drain.enter()

    def _release_drain(self) -> None:
        if self._holding_drain:
            self._holding_drain = False
            self.runtime.drain.leave()

    async def _admit(self, batch: list[PrefillRequest]) -> None:
        """Queued prompts into the engine, as many as the KV blocks not yet promised allow (the rest go
        back to the queue's front); refused ones fail alone."""
        refusals = {r.request_id: why for r in batch if (why := self._refusal(r)) is not None}
        free = self.engine.num_free_blocks() - self.engine.prefill_blocks_pending()
        admission = self.core.admit(batch, free, refusals, engine_idle=not self._prefilling)
        for request, why in admission.refused:
            await self._fail(request, why)
        for request in admission.accepted:
            self.engine.add_prefill(
                request.request_id, list(request.prompt_token_ids), to_params(request.sampling)
            )
            self._prefilling[request.request_id] = request

    async def _forward(self) -> None:
        """One engine forward; the prompts it finished get their first token out and their KV handed off."""
        for rid in [rid for rid in self._prefilling if rid in self.core.ended]:  # cancelled meanwhile
            self.engine.free(rid)
            del self._prefilling[rid]
        if not self._prefilling:
            return
        started = time.perf_counter()
        try:
            finished = await self.engine_thread.call(self._run_engine)
        except Exception as exc:  # an engine failure fails the prompts in it, not the worker
            log.exception("prefill_forward_failed", requests=list(self._prefilling))
            failed, self._prefilling = list(self._prefilling.values()), {}
            for request in failed:
                self.engine.free(request.request_id)
                await self._fail(request, f"prefill failed: {exc}")
            return
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        done = [Prefilled(self._prefilling.pop(out.request_id), out, export) for out, export in finished]
        if not done:
            return
        self.metrics.prompt_tokens.inc(sum(len(item.request.prompt_token_ids) for item in done))
        await self._publish(self.core.first_tokens(done))
        await self._handed_off()  # the forward before this one's: a full pool holds the next forward back
        self.runtime.drain.enter()  # counted from now: a drain waits for these hand-offs
        self._handing_off = asyncio.create_task(self._hand_off_all(done))

    async def _handed_off(self) -> None:
        """Wait for the last forward's hand-offs to finish (they run while the next forward computes)."""
        if self._handing_off is not None:
            task, self._handing_off = self._handing_off, None
            await task

    async def _hand_off_all(self, done: list[Prefilled[KvExport]]) -> None:
        try:
            await asyncio.gather(*(self._hand_off(item) for item in done))
        except BusUnavailable as exc:  # their requests end at their gateway, which lost the bus too
            log.warning("prefill_unpublished", error=str(exc))
        except Exception:  # a hand-off bug must not stop the next forward; each request's lines say which
            log.exception("kv_hand_off_failed", requests=[item.request.request_id for item in done])
        finally:
            self.runtime.drain.leave()

    def _refusal(self, request: PrefillRequest) -> str | None:
        """Why the engine would refuse the request (too long, bad ids or sampling); None: it takes it."""
        try:
            self.engine.check_request(list(request.prompt_token_ids), to_params(request.sampling))
        except (RequestError, ValueError) as exc:
            return str(exc)
        return None

    def _run_engine(self) -> list[tuple[RequestOutput, KvExport | None]]:
        """One prefill forward, then the KV of every prompt it finished copied out (None: the request
        ended at its first token) and its blocks freed (the export owns the bytes). Runs in a thread."""
        finished: list[tuple[RequestOutput, KvExport | None]] = []
        with self.turns.prefill():  # the forward only: copying the KV out is no reason to hold decode back
            outputs = self.engine.prefill_step()
        for output in outputs:
            export = None if output.finished else self.engine.export_kv(output.request_id)
            self.engine.free(output.request_id)
            finished.append((output, export))
        return finished

    async def _hand_off(self, item: Prefilled[KvExport]) -> None:
        # gathered per request: each hand-off's lines carry its own request id
        with request_context(item.request.request_id, item.request.client_request_id):
            await self._hand_off_kv(item)

    async def _hand_off_kv(self, item: Prefilled[KvExport]) -> None:
        export = item.export
        if export is None or not self.core.hands_off(item):
            await self._publish(self.core.ended_at_prefill(item))
            return
        request, output = item.request, item.output
        envelope = KvEnvelope(export.header, request.prompt_token_ids, tuple(output.output_token_ids))
        try:
            location = await self._push_to_pool(request.request_id, envelope.to_bytes(), export)
        except (PushRejected, ValueError) as exc:  # draining with the pool full, or a bad pool address
            await self._fail(request, f"KV hand-off to the pool failed: {exc}")
            return
        except TransferError as exc:  # the pool went away (killed, restarting): only the KV is lost
            log.warning("kv_hand_off_lost", error=str(exc))
            await self._publish(self.core.lost(request, f"KV hand-off to the pool failed: {exc}"))
            return
        if location is None:  # cancelled while the pool was full
            return
        await self._publish(self.core.kv_ready(item, export.header.num_tokens, location, time.time()))
        log.info("kv_handed_off", pool=location.worker_id, tokens=export.header.num_tokens)

    async def _push_to_pool(self, rid: str, envelope: bytes, export: KvExport) -> KvLocation | None:
        """Push until the pool takes it: a full pool is backpressure (wait, retry), never a failure.
        None when the request is cancelled meanwhile."""
        backoff = Backoff(self.settings.pool_retry_s, max_s=POOL_RETRY_MAX_S)
        try:
            pushes = retrying(
                backoff,
                on=PushRejected,
                give_up=lambda: self.runtime.drain.draining,  # no time left to wait for room
                before_sleep=lambda _: self.metrics.pool_full_waits.inc(),
            )
            async for attempt in pushes:
                with attempt:
                    if rid in self.core.ended:
                        return None
                    pool = await self._pool()
                    await self.kv.push(pool, rid, envelope, export)
                    return pool
        except PushRejected as exc:
            raise PushRejected(f"{exc} (the prefill worker is draining)") from exc
        return None

    async def _pool(self) -> KvLocation:
        while self.core.pool is None:
            await asyncio.sleep(POOL_WAIT_S)
        return self.core.pool

    async def _fail(self, request: PrefillRequest, error: str) -> None:
        with request_context(request.request_id, request.client_request_id):
            log.warning("prefill_failed", error=error)
        await self._publish(self.core.failed(request, error))

    # --- staging (candidate buffers) -------------------------------------------------------------------

    async def on_stage(self, message: Message, _delivery: Delivery) -> None:
        if not isinstance(message, BatchPlan):
            return
        with self.runtime.drain.track():
            staged = await asyncio.gather(*(self._stage(p) for p in message.requests))
        self.metrics.staged.inc(sum(staged))
        await self._publish(self.core.prefetch_done(message, staged, self.kv.location()))

    async def _stage(self, planned: PlannedRequest) -> bool:
        """Pull one request's KV into the candidate buffer (served to decode, released after its pull)."""
        with request_context(planned.request_id, planned.state.client_request_id):
            action = self.core.stage(planned)
            if action is Stage.HERE:
                return self.kv.holds(planned.request_id)
            staged = action is Stage.PULL and await self.kv.pull(planned, self.core.ended)
            log.info("kv_staged" if staged else "kv_not_staged", action=action.name.lower())
            return staged

    def staged_lease_expired(self, request_id: str, label: str) -> None:
        """Staged KV no decode worker pulled in time is about to be freed: its request ended somewhere
        no cancel reached this worker from (e.g. its gateway died after its KV was reported lost)."""
        with request_context(request_id, label):
            log.warning("staged_lease_expired", ttl_s=self.settings.staging_lease_ttl_s)
        self.metrics.staged_lease_expired.inc()

    # --- events ----------------------------------------------------------------------------------------

    async def on_event(self, message: Message) -> None:
        if isinstance(message, Cancel | RequestFinished):
            with request_context(message.request_id):
                self.core.end(message.request_id)
                self.kv.drop(message.request_id)
        elif isinstance(message, WorkerHeartbeat):
            self.core.on_heartbeat(message)
