"""`BusBackend`: the disaggregated stack behind the gateway, reached over the control bus.

- submit: open a token stream for the request, publish `PrefillRequest` on the prefill topic;
- tokens: `TokenBatch` messages (one per producer iteration, many requests each) arrive on this
  gateway's own topic; `TokenStreams` keeps every output position exactly once and in order (delivery is
  at-least-once and may reorder across producers), and the released entries go to the request's queue;
- cancel: publish `Cancel` on the events topic, which every service reads (blocks are freed everywhere);
- ready: the bus answers and at least one prefill and one decode worker sent a READY heartbeat lately;
- stats: decode block usage and running requests from the decode workers' `DecodeStatus` reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from alignedserve.bus import Bus, ConsumerOptions, Delivery, Subscription, make_bus, topics
from alignedserve.bus.messages import (
    Cancel,
    DecodeStatus,
    FinishReason,
    Message,
    PrefillRequest,
    RequestFinished,
    SamplingSpec,
    ServiceKind,
    TokenBatch,
    TokenEntry,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.bus.token_stream import TokenStreams
from alignedserve.engine.sampling import SamplingParams
from alignedserve_services.common.logs import get_logger
from alignedserve_services.gateway.backend import (
    FINISH_ABORT,
    BackendError,
    BackendStats,
    GenerationRequest,
    TokenDelta,
    TokenLogprob,
)
from alignedserve_services.gateway.config import GatewaySettings

log = get_logger(__name__)


@dataclass(frozen=True)
class BusBackendOptions:
    gateway_id: str = "gateway"  # names this gateway's token topic; unique per gateway process
    worker_timeout_s: float = 15.0  # a worker counts as alive this long after its last heartbeat
    require_workers: bool = True  # ready() needs a live prefill and decode worker
    heartbeat_interval_s: float = 2.0  # how often this gateway announces itself on the events topic

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> BusBackendOptions:
        return cls(gateway_id=settings.gateway_id, worker_timeout_s=settings.worker_timeout_s)


@dataclass
class _Worker:
    kind: ServiceKind
    state: WorkerState
    seq: int
    seen_at: float  # time.monotonic() of the last heartbeat


@dataclass
class _Cluster:
    """What the gateway knows of the workers, from heartbeats and decode status reports."""

    workers: dict[str, _Worker] = field(default_factory=dict)
    decode_status: dict[str, DecodeStatus] = field(default_factory=dict)

    def heartbeat(self, beat: WorkerHeartbeat, now: float) -> None:
        known = self.workers.get(beat.worker_id)
        if known is not None and beat.seq < known.seq and beat.state is not WorkerState.STARTING:
            return  # an older beat delivered late
        self.workers[beat.worker_id] = _Worker(beat.kind, beat.state, beat.seq, now)
        if beat.state is WorkerState.STOPPED:
            self.decode_status.pop(beat.worker_id, None)

    def status(self, report: DecodeStatus) -> None:
        known = self.decode_status.get(report.worker_id)
        if known is None or report.seq >= known.seq:
            self.decode_status[report.worker_id] = report

    def live(self, kind: ServiceKind, now: float, timeout_s: float) -> list[str]:
        return [
            worker_id
            for worker_id, w in self.workers.items()
            if w.kind is kind and w.state is WorkerState.READY and now - w.seen_at <= timeout_s
        ]


class BusBackend:
    """GenerationBackend over the control bus (see module docstring)."""

    def __init__(self, bus: Bus, options: BusBackendOptions | None = None) -> None:
        self.bus = bus
        self.options = options or BusBackendOptions()
        self._streams = TokenStreams()
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._cluster = _Cluster()
        self._subscriptions: list[Subscription] = []
        self._connected = False
        self._heartbeat: asyncio.Task[None] | None = None
        self._beat_seq = 0
        self._started_at = time.time()

    @classmethod
    def from_url(cls, url: str, options: BusBackendOptions | None = None) -> BusBackend:
        return cls(make_bus(url), options)

    @property
    def supports_logprobs(self) -> bool:
        return True

    @property
    def token_topic(self) -> str:
        return topics.tokens(self.options.gateway_id)

    async def start(self) -> None:
        await self.bus.connect()
        gateway_id = self.options.gateway_id
        # New groups start at the end: tokens of a previous run of this gateway have no reader any more.
        latest = ConsumerOptions(start="latest")
        self._subscriptions = [
            await self.bus.subscribe(
                self.token_topic,
                group=f"gateway-{gateway_id}",
                consumer=gateway_id,
                handler=self._on_message,
                options=latest,
            ),
            await self.bus.subscribe(
                topics.EVENTS, group=gateway_id, consumer=gateway_id, handler=self._on_message, options=latest
            ),
            await self.bus.subscribe(
                topics.BATCHER,
                group=f"gateway-{gateway_id}-status",
                consumer=gateway_id,
                handler=self._on_message,
                options=latest,
            ),
        ]
        for subscription in self._subscriptions:
            await subscription.ready()
        self._connected = True
        self._heartbeat = asyncio.create_task(self._beat_forever(), name="gateway-heartbeat")
        log.info("bus_backend_started", bus=self.bus.url, token_topic=self.token_topic)

    async def close(self) -> None:
        self._connected = False
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            with contextlib.suppress(Exception):  # best effort: the broker may be gone already
                await self._beat(WorkerState.STOPPED)
        for request_id in list(self._queues):
            self._finish_with_abort(request_id)
        for subscription in self._subscriptions:
            await subscription.stop()
        self._subscriptions = []
        await self.bus.close()

    async def _beat_forever(self) -> None:
        """Workers learn of this gateway (and that its token topic has a reader) from these beats."""
        while True:
            try:
                await self._beat(WorkerState.READY)
            except Exception as exc:  # a broker hiccup must not end the heartbeats
                log.warning("heartbeat_failed", error=repr(exc))
            await asyncio.sleep(self.options.heartbeat_interval_s)

    async def _beat(self, state: WorkerState) -> None:
        self._beat_seq += 1
        beat = WorkerHeartbeat(
            kind=ServiceKind.GATEWAY,
            worker_id=self.options.gateway_id,
            state=state,
            seq=self._beat_seq,
            started_at=self._started_at,
        )
        await self.bus.publish(topics.EVENTS, beat)

    def ready(self) -> bool:
        if not self._connected or not all(s.running for s in self._subscriptions):
            return False
        if not self.options.require_workers:
            return True
        now, timeout = time.monotonic(), self.options.worker_timeout_s
        return bool(
            self._cluster.live(ServiceKind.PREFILL, now, timeout)
            and self._cluster.live(ServiceKind.DECODE, now, timeout)
        )

    def stats(self) -> BackendStats:
        live = set(self._cluster.live(ServiceKind.DECODE, time.monotonic(), self.options.worker_timeout_s))
        reports = [r for worker_id, r in self._cluster.decode_status.items() if worker_id in live]
        total = sum(r.total_blocks for r in reports)
        used = sum(r.total_blocks - r.free_blocks for r in reports)
        running = sum(r.running for r in reports)
        return BackendStats(
            num_requests_running=running,
            num_requests_waiting=max(0, len(self._queues) - running),
            decode_kv_usage=used / total if total else 0.0,
        )

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if not self._connected:
            raise BackendError("the bus backend is not connected")
        self._streams.open(request.request_id)
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[request.request_id] = queue
        message = PrefillRequest(
            request_id=request.request_id,
            model=request.model,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_spec(request.sampling),
            arrival=time.time(),
            gateway_id=self.options.gateway_id,
        )
        try:
            await self.bus.publish(topics.PREFILL, message)
        except Exception as exc:
            self._forget(request.request_id)
            raise BackendError(f"could not publish the request to {topics.PREFILL}: {exc}") from exc
        return self._deltas(request.request_id, queue)

    async def _deltas(self, request_id: str, queue: asyncio.Queue[TokenDelta]) -> AsyncIterator[TokenDelta]:
        try:
            while True:
                delta = await queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._forget(request_id)

    async def cancel(self, request_id: str) -> None:
        self._forget(request_id)
        await self.bus.publish(topics.EVENTS, Cancel(request_id=request_id, reason="client disconnected"))

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._streams.close(request_id)

    # --- consumed messages (idempotent: TokenStreams drops positions already released) ----------------

    async def _on_message(self, message: Message, _delivery: Delivery) -> None:
        if isinstance(message, TokenBatch):
            self._on_tokens(message)
        elif isinstance(message, RequestFinished):
            self._on_finished(message)
        elif isinstance(message, WorkerHeartbeat):
            self._cluster.heartbeat(message, time.monotonic())
        elif isinstance(message, DecodeStatus):
            self._cluster.status(message)

    def _on_tokens(self, batch: TokenBatch) -> None:
        for request_id, entries in self._streams.accept(batch).items():
            queue = self._queues.get(request_id)
            if queue is None:
                continue
            for entry in entries:
                queue.put_nowait(token_delta(entry))

    def _on_finished(self, finished: RequestFinished) -> None:
        # Normal ends arrive as the finish reason of the last TokenEntry; this covers failures only.
        if (
            finished.finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
            and finished.request_id in self._queues
        ):
            log.warning(
                "request_failed_in_stack",
                id=finished.request_id,
                reason=finished.finish_reason,
                error=finished.error,
            )
            self._finish_with_abort(finished.request_id)

    def _finish_with_abort(self, request_id: str) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(TokenDelta(index=0, token_ids=(), finish_reason=FINISH_ABORT))
        self._streams.close(request_id)


def sampling_spec(params: SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
    )


def token_delta(entry: TokenEntry) -> TokenDelta:
    logprobs: tuple[TokenLogprob, ...] = ()
    if entry.logprobs is not None:
        tops = entry.top_logprobs or ()
        logprobs = tuple(
            TokenLogprob(
                token_id,
                logprob,
                tuple(zip(tops[i].token_ids, tops[i].logprobs, strict=True)) if i < len(tops) else (),
            )
            for i, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs, strict=True))
        )
    reason = entry.finish_reason
    finish = (
        None
        if reason is None
        else (FINISH_ABORT if reason in (FinishReason.ABORT, FinishReason.ERROR) else str(reason))
    )
    return TokenDelta(
        index=entry.first_index, token_ids=entry.token_ids, logprobs=logprobs, finish_reason=finish
    )
