"""The prefill worker's jobs around its engine: prompts to first tokens, KV to the pool, batch staging.

1. Prompts (PREFILL topic, group `prefill`) queue here; one loop prefills what is queued in one engine
   call (up to `max_prefill_tokens`), sends each first token to its gateway, and hands every unfinished
   request's KV to the kvpool (UCX push; *pool full* → back off and retry, taking no new prompts), then
   announces it to the batcher (`KvReady`) and frees its blocks.
2. Staging (its `stage` topic): for a `BatchPlan` it pulls each request's KV from where it is into its
   candidate buffers and tells the decode worker (`PrefetchDone`); decode workers pull from there, and
   push evicted requests' KV into its candidate request buffer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from alignedserve.batching.types import blocks_for
from alignedserve.bus import Delivery, SeenIds, topics
from alignedserve.bus.messages import (
    BatchPlan,
    Cancel,
    FinishReason,
    KvLocation,
    KvReady,
    Message,
    PlannedRequest,
    PrefetchDone,
    PrefillRequest,
    PromptScore,
    RequestFinished,
    RequestState,
    ServiceKind,
    TokenBatch,
    TokenEntry,
    TopLogprobs,
    WorkerHeartbeat,
    WorkerState,
    new_message_id,
)
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_envelope import KvEnvelope
from alignedserve.engine.kv_export import KvExport
from alignedserve.engine.request import RequestError, RequestOutput, TokenLogprob
from alignedserve.prefill.config import PrefillSettings
from alignedserve.prefill.metrics import PrefillMetrics
from alignedserve.service.logs import get_logger
from alignedserve.service.sampling import to_params
from alignedserve.service.worker import WorkerRuntime
from alignedserve.transfer import (
    DestinationError,
    DestinationFactory,
    PeerAddress,
    PushRejected,
    TransferEndpoint,
    TransferError,
)
from alignedserve.transfer.kv_store import PoolFull, StoreSink

log = get_logger("alignedserve.prefill")
RECENT_TOKENS = 32  # output tokens a RequestState carries (the full history rides with the KV)
POOL_RETRY_MAX_S = 2.0


@dataclass(frozen=True)
class Prefilled:
    request: PrefillRequest
    output: RequestOutput
    export: KvExport | None  # None: the request ended at its first token


def take_batch(queue: deque[PrefillRequest], max_tokens: int, max_seqs: int) -> list[PrefillRequest]:
    """The oldest queued prompts up to the token budget (always at least one: the engine chunks it)."""
    batch = [queue.popleft()]
    tokens = len(batch[0].prompt_token_ids)
    while queue and len(batch) < max_seqs and tokens + len(queue[0].prompt_token_ids) <= max_tokens:
        tokens += len(queue[0].prompt_token_ids)
        batch.append(queue.popleft())
    return batch


def first_tokens(worker_id: str, iteration: int, done: list[Prefilled]) -> dict[str, TokenBatch]:
    """One TokenBatch per gateway with every first token of this prefill (output position 0)."""
    entries: dict[str, list[TokenEntry]] = defaultdict(list)
    scores: dict[str, list[PromptScore]] = defaultdict(list)
    for item in done:
        entries[item.request.gateway_id].append(first_entry(item.output))
        if item.output.prompt_logprobs is not None:
            scores[item.request.gateway_id].append(
                prompt_score(item.output.request_id, item.output.prompt_logprobs)
            )
    return {
        gw: TokenBatch(
            worker_id=worker_id, iteration=iteration, entries=tuple(e), prompt_scores=tuple(scores[gw])
        )
        for gw, e in entries.items()
    }


def first_entry(out: RequestOutput) -> TokenEntry:
    logprobs = out.logprobs
    return TokenEntry(
        request_id=out.request_id,
        first_index=0,
        token_ids=tuple(out.output_token_ids),
        finish_reason=FinishReason(out.finish_reason) if out.finished and out.finish_reason else None,
        logprobs=None if logprobs is None else tuple(lp.logprob for lp in logprobs),
        top_logprobs=None if logprobs is None else tuple(top_alternatives(lp) for lp in logprobs),
    )


def prompt_score(request_id: str, prompt: list[TokenLogprob]) -> PromptScore:
    return PromptScore(
        request_id=request_id,
        logprobs=tuple(lp.logprob for lp in prompt),
        top_logprobs=tuple(top_alternatives(lp) for lp in prompt),
    )


def top_alternatives(logprob: TokenLogprob) -> TopLogprobs:
    return TopLogprobs(
        token_ids=tuple(token for token, _ in logprob.top),
        logprobs=tuple(value for _, value in logprob.top),
    )


class PrefillWorker:
    def __init__(
        self,
        settings: PrefillSettings,
        runtime: WorkerRuntime,
        engine: LLMEngine,
        endpoint: TransferEndpoint,
        staging_sink: StoreSink,
        metrics: PrefillMetrics,
    ) -> None:
        self.settings = settings
        self.runtime = runtime
        self.engine = engine
        self.endpoint = endpoint
        self.staging_sink = staging_sink  # candidate buffers: staged batches and evicted requests
        self.metrics = metrics
        self.queue: deque[PrefillRequest] = deque()
        self.cancelled = SeenIds(100_000)
        self.taken = SeenIds(100_000)  # request ids queued here before
        staging_sink.cancelled = self.cancelled  # a push of an ended request is not kept
        self.pool: PeerAddress | None = None
        self.pool_id = ""
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._iteration = 0
        self._holding_drain = False  # the queue counts as in-flight work while it is not empty

    # --- prompts ---------------------------------------------------------------------------------------

    async def on_prompt(self, message: Message, _delivery: Delivery) -> None:
        if not isinstance(message, PrefillRequest) or message.request_id in self.cancelled:
            return
        if message.request_id in self.taken:  # re-published or redelivered: prefilled once only
            return
        await self._room.wait()  # a full queue stops consumption: other prefill workers take the prompts
        if self.runtime.drain.draining:  # acknowledged here, so hand it to another worker
            await self.runtime.bus.publish(topics.PREFILL, handed_back(message))
            return
        self.taken.add(message.request_id)
        self._hold_drain()
        self.queue.append(message)
        self.metrics.queued.set(len(self.queue))
        if len(self.queue) >= self.settings.max_queue:
            self._room.clear()
        self._wake.set()

    async def prefill_loop(self) -> None:
        while True:
            while not self.queue:
                self._wake.clear()
                await self._wake.wait()
            while self.queue:
                if self.runtime.drain.draining:
                    await self._hand_back_queue()
                    break
                batch = take_batch(self.queue, self.settings.max_prefill_tokens, self.settings.max_num_seqs)
                self.metrics.queued.set(len(self.queue))
                self._room.set()
                await self._prefill(batch)
            self._release_drain()

    async def _hand_back_queue(self) -> None:
        """Draining: prompts not started yet go back on the bus for the other prefill workers."""
        while self.queue:
            request = self.queue.popleft()
            self.taken.discard(request.request_id)
            await self.runtime.bus.publish(topics.PREFILL, handed_back(request))
        self.metrics.queued.set(0)
        log.info("prefill_queue_handed_back")

    def _hold_drain(self) -> None:
        """Queued prompts are acknowledged on the bus already: a drain waits until they are prefilled."""
        if not self._holding_drain:
            self._holding_drain = True
            self.runtime.drain.enter()

    def _release_drain(self) -> None:
        if self._holding_drain:
            self._holding_drain = False
            self.runtime.drain.leave()

    async def _prefill(self, batch: list[PrefillRequest]) -> None:
        started = time.perf_counter()
        accepted = await self._admit(batch)
        if not accepted:
            return
        try:
            done = await asyncio.to_thread(self._run_engine, accepted)
        except Exception as exc:  # an engine failure fails this batch, not the worker
            log.exception("prefill_forward_failed", requests=[r.request_id for r in accepted])
            for request in accepted:
                self.engine.free(request.request_id)
                await self._fail(request, f"prefill failed: {exc}")
            return
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in accepted))
        self._iteration += 1
        for gateway_id, tokens in first_tokens(self.runtime.worker_id, self._iteration, done).items():
            await self.runtime.bus.publish(topics.tokens(gateway_id), tokens)
        await asyncio.gather(*(self._hand_off(item) for item in done))

    def _run_engine(self, accepted: list[PrefillRequest]) -> list[Prefilled]:
        """One batched prefill, then every unfinished request's KV copied out and its blocks freed
        (the export owns the bytes), so the next batch has the whole cache. Runs in a thread."""
        outputs = self.engine.prefill(
            [(r.request_id, list(r.prompt_token_ids), to_params(r.sampling)) for r in accepted]
        )
        done = []
        for request, output in zip(accepted, outputs, strict=True):
            export = None if output.finished else self.engine.export_kv(request.request_id)
            self.engine.free(request.request_id)
            done.append(Prefilled(request, output, export))
        return done

    async def _admit(self, batch: list[PrefillRequest]) -> list[PrefillRequest]:
        """Requests the engine refuses (too long, bad ids) fail alone; those that do not fit the free
        KV blocks together go back to the queue's front; the rest prefill together."""
        accepted: list[PrefillRequest] = []
        deferred: list[PrefillRequest] = []
        free_blocks = self.engine.num_free_blocks()
        for request in batch:
            if request.request_id in self.cancelled:
                continue
            try:
                self.engine.check_request(list(request.prompt_token_ids), to_params(request.sampling))
            except (RequestError, ValueError) as exc:
                await self._fail(request, str(exc))
                continue
            need = blocks_for(len(request.prompt_token_ids) + 1, self.settings.block_size)
            if accepted and need > free_blocks:
                deferred.append(request)
                continue
            free_blocks -= need
            accepted.append(request)
        self.queue.extendleft(reversed(deferred))
        return accepted

    async def _hand_off(self, item: Prefilled) -> None:
        request, output, export = item.request, item.output, item.export
        rid = request.request_id
        if export is None or rid in self.cancelled:
            reason = FinishReason(output.finish_reason) if output.finish_reason else FinishReason.ABORT
            await self._finished(request, reason, len(output.output_token_ids))
            return
        envelope = KvEnvelope(export.header, request.prompt_token_ids, tuple(output.output_token_ids))
        try:
            location = await self._push_to_pool(rid, envelope.to_bytes(), export)
        except TransferError as exc:
            await self._fail(request, f"KV hand-off to the pool failed: {exc}")
            return
        if location is None:  # cancelled while the pool was full
            return
        ready = KvReady(
            request_id=rid,
            prefix_len=export.header.num_tokens,
            blocks=blocks_for(export.header.num_tokens, self.settings.block_size),
            location=location,
            state=request_state(request, output.output_token_ids),
            arrival=time.time(),
        )
        await self.runtime.bus.publish(topics.BATCHER, ready)

    async def _push_to_pool(self, rid: str, header: bytes, export: KvExport) -> KvLocation | None:
        """Push until the pool takes it: a full pool is backpressure (wait, retry), never a failure.
        None when the request is cancelled meanwhile."""
        delay = self.settings.pool_retry_s
        while rid not in self.cancelled:
            pool, pool_id = await self._pool_address()
            try:
                await self.endpoint.push(pool, rid, header, export.payload, checksum=export.header.checksum)
                return KvLocation(worker_id=pool_id, kind=ServiceKind.KVPOOL, ucx_address_key=pool.to_wire())
            except PushRejected as exc:
                if self.runtime.drain.draining:  # no time left to wait for room
                    raise PushRejected(f"{exc} (the prefill worker is draining)") from exc
                self.metrics.pool_full_waits.inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, POOL_RETRY_MAX_S)
        return None

    async def _pool_address(self) -> tuple[PeerAddress, str]:
        while self.pool is None:
            await asyncio.sleep(0.05)  # the kvpool's heartbeat carries its address
        return self.pool, self.pool_id

    async def _finished(
        self, request: PrefillRequest, reason: FinishReason, completion: int, error: str = ""
    ) -> None:
        done = RequestFinished(
            request_id=request.request_id,
            worker_id=self.runtime.worker_id,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=completion,
            error=error,
        )
        await self.runtime.bus.publish(topics.tokens(request.gateway_id), done)
        await self.runtime.bus.publish(topics.EVENTS, done)

    async def _fail(self, request: PrefillRequest, error: str) -> None:
        log.warning("prefill_failed", request_id=request.request_id, error=error)
        await self._finished(request, FinishReason.ERROR, 0, error)

    # --- staging (candidate buffers) -------------------------------------------------------------------

    async def on_stage(self, message: Message, _delivery: Delivery) -> None:
        if not isinstance(message, BatchPlan):
            return
        with self.runtime.drain.track():
            results = await asyncio.gather(*(self._stage(p) for p in message.requests))
        ready = tuple(p.request_id for p, ok in zip(message.requests, results, strict=True) if ok)
        failed = tuple(p.request_id for p, ok in zip(message.requests, results, strict=True) if not ok)
        done = PrefetchDone(
            batch_id=message.batch_id,
            staging_worker_id=self.runtime.worker_id,
            decode_worker_id=message.decode_worker_id,
            buffer=message.buffer,
            ready=ready,
            failed=failed,
            location=self.location(),
        )
        self.metrics.staged.inc(len(ready))
        await self.runtime.bus.publish(topics.decode(message.decode_worker_id), done)
        await self.runtime.bus.publish(topics.BATCHER, done)

    async def _stage(self, planned: PlannedRequest) -> bool:
        """Pull one request's KV into the candidate buffer (served to decode, released after its pull)."""
        rid = planned.request_id
        if rid in self.cancelled:
            return False
        if planned.location.worker_id == self.runtime.worker_id:
            return rid in self.endpoint.registry  # already here (an evicted request pushed back to us)
        try:
            pulled = await self.endpoint.pull(
                PeerAddress.from_wire(planned.location.ucx_address_key), rid, self._staging_buffer(rid)
            )
        except (TransferError, ValueError) as exc:
            self._discard_staged(rid)
            log.warning("stage_failed", request_id=rid, error=str(exc))
            return False
        if rid in self.cancelled:  # cancelled while it arrived
            self._discard_staged(rid)
            return False
        self.staging_sink.commit(rid, pulled.header, pulled.buffer)
        return True

    def _staging_buffer(self, rid: str) -> DestinationFactory:
        """Room in the candidate buffer for the pulled payload; a full buffer refuses the pull cleanly
        (DestinationError: the client drains the offered bytes, so the holder's entry is unpinned)."""

        def allocate(header: bytes, nbytes: int) -> bytearray:
            try:
                buffer: bytearray = self.staging_sink.store.reserve(rid, header, nbytes)
            except PoolFull as exc:
                raise DestinationError(f"staging buffer full: {exc}") from exc
            return buffer

        return allocate

    def _discard_staged(self, rid: str) -> None:
        if rid not in self.endpoint.registry:
            self.staging_sink.store.release(rid)

    def location(self) -> KvLocation:
        return KvLocation(
            worker_id=self.runtime.worker_id,
            kind=ServiceKind.PREFILL,
            ucx_address_key=self.endpoint.address.to_wire(),
        )

    # --- events ----------------------------------------------------------------------------------------

    async def on_event(self, message: Message) -> None:
        if isinstance(message, Cancel | RequestFinished):
            self.cancelled.add(message.request_id)
            self.endpoint.registry.drop(message.request_id)
        elif (
            isinstance(message, WorkerHeartbeat)
            and message.kind is ServiceKind.KVPOOL
            and message.ucx_address
            and message.state is not WorkerState.STOPPED
        ):
            self.pool = PeerAddress.from_wire(message.ucx_address)
            self.pool_id = message.worker_id


def request_state(request: PrefillRequest, output_token_ids: list[int]) -> RequestState:
    return RequestState(
        gateway_id=request.gateway_id,
        sampling=request.sampling,
        prompt_len=len(request.prompt_token_ids),
        output_len=len(output_token_ids),
        recent_token_ids=tuple(output_token_ids[-RECENT_TOKENS:]),
    )


def handed_back(request: PrefillRequest) -> PrefillRequest:
    """The same prompt as a new bus message (a fresh message id: consumers that saw the old one
    would drop it as a duplicate)."""
    return dataclasses.replace(request, message_id=new_message_id(), created_at=time.time())
