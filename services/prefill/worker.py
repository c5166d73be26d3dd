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
    RequestFinished,
    RequestState,
    ServiceKind,
    TokenBatch,
    TokenEntry,
    WorkerHeartbeat,
)
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.request import RequestError, RequestOutput
from alignedserve.kvcache.export import KvExport
from alignedserve.transfer import PeerAddress, PushRejected, TransferEndpoint, TransferError
from alignedserve_services.common.kv_envelope import KvEnvelope
from alignedserve_services.common.kv_store import StoreSink
from alignedserve_services.common.logs import get_logger
from alignedserve_services.common.sampling import to_params
from alignedserve_services.common.worker import WorkerRuntime
from alignedserve_services.prefill.config import PrefillSettings
from alignedserve_services.prefill.metrics import PrefillMetrics

log = get_logger("alignedserve.prefill")
RECENT_TOKENS = 32  # output tokens a RequestState carries (the full history rides with the KV)
POOL_RETRY_MAX_S = 2.0


@dataclass(frozen=True)
class Prefilled:
    request: PrefillRequest
    output: RequestOutput


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
    for item in done:
        out = item.output
        reason = FinishReason(out.finish_reason) if out.finish_reason else None
        logprobs = None if out.logprobs is None else tuple(lp.logprob for lp in out.logprobs)
        entries[item.request.gateway_id].append(
            TokenEntry(
                request_id=out.request_id,
                first_index=0,
                token_ids=tuple(out.output_token_ids),
                finish_reason=reason,
                logprobs=logprobs,
            )
        )
    return {
        gw: TokenBatch(worker_id=worker_id, iteration=iteration, entries=tuple(e))
        for gw, e in entries.items()
    }


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
        self.pool: PeerAddress | None = None
        self.pool_id = ""
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._iteration = 0

    # --- prompts ---------------------------------------------------------------------------------------

    async def on_prompt(self, message: Message, _delivery: Delivery) -> None:
        if not isinstance(message, PrefillRequest) or message.request_id in self.cancelled:
            return
        await self._room.wait()  # a full queue stops consumption: other prefill workers take the prompts
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
            batch = take_batch(self.queue, self.settings.max_prefill_tokens, self.settings.max_num_seqs)
            self.metrics.queued.set(len(self.queue))
            self._room.set()
            with self.runtime.drain.track():
                await self._prefill(batch)

    async def _prefill(self, batch: list[PrefillRequest]) -> None:
        started = time.perf_counter()
        accepted, rejected = self._admit(batch)
        for request, error in rejected:
            await self._fail(request, error)
        if not accepted:
            return
        outputs = await asyncio.to_thread(
            self.engine.prefill,
            [(r.request_id, list(r.prompt_token_ids), to_params(r.sampling)) for r in accepted],
        )
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in accepted))
        self._iteration += 1
        done = [Prefilled(r, o) for r, o in zip(accepted, outputs, strict=True)]
        for gateway_id, tokens in first_tokens(self.runtime.worker_id, self._iteration, done).items():
            await self.runtime.bus.publish(topics.tokens(gateway_id), tokens)
        await asyncio.gather(*(self._hand_off(item) for item in done))

    def _admit(
        self, batch: list[PrefillRequest]
    ) -> tuple[list[PrefillRequest], list[tuple[PrefillRequest, str]]]:
        """Requests the engine refuses (too long, bad ids) fail alone; the rest prefill together."""
        accepted, rejected = [], []
        for request in batch:
            if request.request_id in self.cancelled:
                continue
            try:
                self.engine.check_request(list(request.prompt_token_ids), to_params(request.sampling))
            except RequestError as exc:
                rejected.append((request, str(exc)))
            else:
                accepted.append(request)
        return accepted, rejected

    async def _hand_off(self, item: Prefilled) -> None:
        request, output = item.request, item.output
        rid = request.request_id
        try:
            if output.finished or rid in self.cancelled:
                reason = FinishReason(output.finish_reason) if output.finished else FinishReason.ABORT
                await self._finished(request, reason, len(output.output_token_ids))
                return
            export = await asyncio.to_thread(self.engine.export_kv, rid)
            envelope = KvEnvelope(export.header, request.prompt_token_ids, tuple(output.output_token_ids))
            location = await self._push_to_pool(rid, envelope.to_bytes(), export)
            ready = KvReady(
                request_id=rid,
                prefix_len=export.header.num_tokens,
                blocks=blocks_for(export.header.num_tokens, self.settings.block_size),
                location=location,
                state=request_state(request, output.output_token_ids),
                arrival=time.time(),
            )
            await self.runtime.bus.publish(topics.BATCHER, ready)
        except TransferError as exc:
            await self._fail(request, f"KV hand-off to the pool failed: {exc}")
        finally:
            self.engine.free(rid)

    async def _push_to_pool(self, rid: str, header: bytes, export: KvExport) -> KvLocation:
        """Push until the pool takes it: a full pool is backpressure (wait, retry), never a failure."""
        delay = self.settings.pool_retry_s
        while True:
            pool, pool_id = await self._pool_address()
            try:
                await self.endpoint.push(pool, rid, header, export.payload, checksum=export.header.checksum)
                return KvLocation(worker_id=pool_id, kind=ServiceKind.KVPOOL, ucx_address_key=pool.to_wire())
            except PushRejected:
                self.metrics.pool_full_waits.inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, POOL_RETRY_MAX_S)

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

    async def _stage(self, planned: PlannedRequest) -> bool:
        """Pull one request's KV into the candidate buffer (served to decode, released after its pull)."""
        rid = planned.request_id
        if rid in self.cancelled:
            return False
        if planned.location.worker_id == self.runtime.worker_id:
            return rid in self.endpoint.registry  # already here (an evicted request pushed back to us)
        store = self.staging_sink.store
        try:
            pulled = await self.endpoint.pull(
                PeerAddress.from_wire(planned.location.ucx_address_key),
                rid,
                lambda header, nbytes: store.reserve(rid, header, nbytes),
            )
        except TransferError as exc:
            store.release(rid)
            log.warning("stage_failed", request_id=rid, error=str(exc))
            return False
        self.staging_sink.commit(rid, pulled.header, pulled.buffer)
        return True

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
