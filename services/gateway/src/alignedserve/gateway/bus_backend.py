"""`BusBackend`: the disaggregated stack behind the gateway, reached over the control bus.

- submit: open a token stream for the request, publish `PrefillRequest` on the prefill topic;
- tokens: `TokenBatch` messages (one per producer iteration, many requests each) arrive on this
  gateway's own topic; `TokenStreams` keeps every output position exactly once and in order (delivery is
  at-least-once and may reorder across producers), and the released entries go to the request's queue;
- cancel: publish `Cancel` on the events topic, which every service reads (blocks are freed everywhere);
- migration: a request whose KV is lost (`RequestLost`), or whose holding worker stops beating, is
  cancelled and prefilled again from its prompt plus the tokens already released, under a new
  incarnation id, at most `max_migrations` times (see `migration.py`);
- ready: the bus answers and at least one prefill and one decode worker sent a READY heartbeat lately;
- stats: decode block usage and running requests from the decode workers' `DecodeStatus` reports; KV
  pool usage from the kvpools' heartbeats (bytes held / budget, summed over the live pools).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from alignedserve.bus import Bus, ConsumerOptions, Delivery, Subscription, make_bus, topics
from alignedserve.bus.messages import (
    BatchPlan,
    Cancel,
    DecodeStatus,
    FinishReason,
    KvReady,
    Message,
    PrefetchDone,
    PrefillRequest,
    PromptScore,
    RequestEvicted,
    RequestFinished,
    RequestLost,
    ServiceKind,
    TokenBatch,
    TokenEntry,
    TopLogprobs,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.bus.token_stream import TokenStreams
from alignedserve.gateway.backend import (
    FINISH_ABORT,
    BackendError,
    BackendStats,
    GenerationRequest,
    TokenDelta,
    TokenLogprob,
)
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.migration import (
    KV_LOST,
    PREFILL_DIED,
    WORKER_DIED,
    GiveUp,
    Migration,
    MigrationBook,
)
from alignedserve.service.logs import get_logger
from alignedserve.service.sampling import to_spec

log = get_logger(__name__)


@dataclass(frozen=True)
class BusBackendOptions:
    gateway_id: str = "gateway"  # names this gateway's token topic; unique per gateway process
    worker_timeout_s: float = 15.0  # a worker counts as alive this long after its last heartbeat
    require_workers: bool = True  # ready() needs a live prefill and decode worker
    heartbeat_interval_s: float = 2.0  # how often this gateway announces itself on the events topic
    max_migrations: int = 3  # re-prefills of one request whose KV or worker was lost, then it fails
    watch_interval_s: float = 0.5  # how often silent workers are looked for (their requests migrate)

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> BusBackendOptions:
        return cls(
            gateway_id=settings.gateway_id,
            worker_timeout_s=settings.worker_timeout_s,
            max_migrations=settings.max_migrations,
        )


@dataclass
class _Worker:
    kind: ServiceKind
    state: WorkerState
    seq: int
    seen_at: float  # time.monotonic() of the last heartbeat
    started_at: float  # wall clock its process started: tells a restart from a late beat


@dataclass
class _Cluster:
    """What the gateway knows of the workers, from heartbeats and decode status reports."""

    workers: dict[str, _Worker] = field(default_factory=dict)
    decode_status: dict[str, DecodeStatus] = field(default_factory=dict)
    kv_pool_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)  # kvpool id -> (used, capacity)

    def heartbeat(self, beat: WorkerHeartbeat, now: float) -> bool:
        """Record a beat; True when it comes from a newer process than the one last seen under its id
        (the old process, and whatever it held, is gone). seq counts per process: a restarted worker's
        low seq is not a late beat."""
        known = self.workers.get(beat.worker_id)
        if known is not None and (
            beat.started_at < known.started_at
            or (
                beat.started_at == known.started_at
                and beat.seq < known.seq
                and beat.state is not WorkerState.STARTING
            )
        ):
            return False  # a beat of an older process, or of this one, delivered late
        self.workers[beat.worker_id] = _Worker(beat.kind, beat.state, beat.seq, now, beat.started_at)
        restarted = known is not None and beat.started_at > known.started_at
        if beat.state is WorkerState.STOPPED:
            self.decode_status.pop(beat.worker_id, None)
            self.kv_pool_bytes.pop(beat.worker_id, None)
        elif beat.kind is ServiceKind.KVPOOL and beat.kv_capacity_bytes > 0:
            self.kv_pool_bytes[beat.worker_id] = (beat.kv_used_bytes, beat.kv_capacity_bytes)
        return restarted

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

    def dead(self, now: float, timeout_s: float) -> dict[str, ServiceKind]:
        """Workers silent for longer than `timeout_s` whose last beat was not STOPPED: killed, hung or
        cut off. A graceful stop (drain, then STOPPED) hands its requests back and is not death."""
        return {
            worker_id: w.kind
            for worker_id, w in self.workers.items()
            if w.state is not WorkerState.STOPPED and now - w.seen_at > timeout_s
        }


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
        self._watcher: asyncio.Task[None] | None = None
        self._beat_seq = 0
        self._started_at = time.time()
        self._book = MigrationBook(self.options.max_migrations)
        self._migrations: collections.Counter[str] = collections.Counter()  # reason -> migrations
        self._dead_prefill: set[str] = set()  # dead prefill workers whose requests were moved already

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
        self._watcher = asyncio.create_task(self._watch_forever(), name="gateway-worker-watch")
        log.info("bus_backend_started", bus=self.bus.url, token_topic=self.token_topic)

    async def close(self) -> None:
        self._connected = False
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
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
        pools = set(self._cluster.live(ServiceKind.KVPOOL, time.monotonic(), self.options.worker_timeout_s))
        pool_bytes = [b for worker_id, b in self._cluster.kv_pool_bytes.items() if worker_id in pools]
        pool_capacity = sum(capacity for _, capacity in pool_bytes)
        return BackendStats(
            num_requests_running=running,
            num_requests_waiting=max(0, len(self._queues) - running),
            kv_pool_usage=sum(held for held, _ in pool_bytes) / pool_capacity if pool_capacity else 0.0,
            decode_kv_usage=used / total if total else 0.0,
        )

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if not self._connected:
            raise BackendError("the bus backend is not connected")
        arrival = time.time()
        try:
            self._book.open(request, arrival)
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        self._streams.open(request.request_id)
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[request.request_id] = queue
        message = PrefillRequest(
            request_id=request.request_id,
            model=request.model,
            prompt_token_ids=request.prompt_token_ids,
            sampling=to_spec(request.sampling),
            arrival=arrival,
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
        incarnation = self._book.incarnation(request_id) or request_id  # the id the stack knows it by now
        self._forget(request_id)
        await self.bus.publish(topics.EVENTS, Cancel(request_id=incarnation, reason="client disconnected"))

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._streams.close(request_id)
        self._book.close(request_id)

    def migration_counts(self) -> dict[str, int]:
        """Migrations so far by reason (the gateway's `request_migrations_total` counter)."""
        return dict(self._migrations)

    # --- consumed messages (idempotent: TokenStreams drops positions already released) ----------------

    async def _on_message(self, message: Message, _delivery: Delivery) -> None:
        if isinstance(message, TokenBatch):
            self._on_tokens(message)
        elif isinstance(message, RequestFinished):
            self._on_finished(message)
        elif isinstance(message, RequestLost):
            decision = self._book.lost(message.request_id, KV_LOST, f"{message.worker_id}: {message.reason}")
            await self._move(decision)
        elif isinstance(message, WorkerHeartbeat):
            restarted = self._cluster.heartbeat(message, time.monotonic())
            if restarted:  # back before it was missed: what its old process held is gone all the same
                await self._move_held_by({message.worker_id}, "restarted")
        elif isinstance(message, DecodeStatus):
            self._cluster.status(message)
        else:
            self._on_placed(message)

    def _on_placed(self, message: Message) -> None:
        """Where a request's KV went (batcher topic): who holds it now, for `_watch_forever`."""
        if isinstance(message, KvReady):
            self._book.held(message.request_id, message.location.worker_id, message.created_at)
        elif isinstance(message, BatchPlan):  # planned for this decode worker: its candidate now
            for request_id in message.request_ids:
                self._book.held(request_id, message.decode_worker_id, message.created_at)
        elif isinstance(message, PrefetchDone):
            for request_id in message.ready:  # staged for this decode worker: its candidate now
                self._book.held(request_id, message.decode_worker_id, message.created_at)
        elif isinstance(message, RequestEvicted) and message.to is None:  # handed back to the pool
            self._book.held(message.request_id, message.location.worker_id, message.created_at)

    def _on_tokens(self, batch: TokenBatch) -> None:
        for score in batch.prompt_scores:  # ahead of the first tokens they came with
            self._on_prompt_score(score)
        for raw in batch.entries:
            self._book.held(raw.request_id, batch.worker_id, batch.created_at)
            entry = self._book.translate(raw)  # the client's id and positions; None: superseded
            if entry is None or entry.request_id not in self._streams:
                continue
            released = self._streams[entry.request_id].accept(entry)
            self._book.released(entry.request_id, released)
            queue = self._queues.get(entry.request_id)
            if queue is None:
                continue
            for fresh in released:
                queue.put_nowait(token_delta(fresh))

    def _on_prompt_score(self, score: PromptScore) -> None:
        request_id = self._book.owner(score.request_id)  # None: not this gateway's, or superseded
        tracked = None if request_id is None else self._book.get(request_id)
        queue = None if request_id is None else self._queues.get(request_id)
        if tracked is not None and queue is not None:
            queue.put_nowait(prompt_delta(score, tracked.request.prompt_token_ids))

    def _on_finished(self, finished: RequestFinished) -> None:
        # Normal ends arrive as the finish reason of the last TokenEntry; this covers failures only.
        request_id = self._book.owner(finished.request_id)  # None: a superseded incarnation's end
        if (
            finished.finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
            and request_id is not None
            and request_id in self._queues
        ):
            log.warning(
                "request_failed_in_stack",
                id=request_id,
                incarnation=finished.request_id,
                reason=finished.finish_reason,
                error=finished.error,
            )
            self._finish_with_abort(request_id)

    # --- migration: lost KV and dead workers ------------------------------------------------------------

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.watch_interval_s)
            try:
                await self._move_from_dead_workers()
            except Exception as exc:  # a broker hiccup must not end the watch
                log.warning("worker_watch_failed", error=repr(exc))

    async def _move_from_dead_workers(self) -> None:
        """Requests held by a worker that stopped beating move; so do the requests no worker holds yet
        (queued or being prefilled) when a prefill worker dies, once per death."""
        dead = self._cluster.dead(time.monotonic(), self.options.worker_timeout_s)
        await self._move_held_by(set(dead), "stopped beating")
        dead_prefill = {w for w, kind in dead.items() if kind is ServiceKind.PREFILL}
        newly = sorted(dead_prefill - self._dead_prefill)
        self._dead_prefill = dead_prefill  # one that beats again and dies again counts again
        if newly:
            for request_id in self._book.unheld():
                detail = f"{', '.join(newly)} stopped beating before it produced a token"
                await self._move(self._book.migrate(request_id, PREFILL_DIED, detail))

    async def _move_held_by(self, workers: set[str], what: str) -> None:
        for request_id in self._book.held_by(workers):
            tracked = self._book.get(request_id)
            holder = tracked.holder if tracked is not None else "?"
            await self._move(self._book.migrate(request_id, WORKER_DIED, f"{holder} {what}"))

    async def _move(self, decision: Migration | GiveUp | None) -> None:
        """Apply the book's decision: cancel the old incarnation everywhere, then prefill the new one."""
        if decision is None:
            return
        old = decision.old_incarnation if isinstance(decision, Migration) else decision.incarnation
        cancel = Cancel(request_id=old, reason=f"request lost ({decision.reason})")
        messages: list[tuple[str, Message]] = [(topics.EVENTS, cancel)]
        if isinstance(decision, GiveUp):
            log.warning("request_migrations_exhausted", id=decision.request_id, incarnation=old,
                        migrations=decision.count, reason=decision.reason, detail=decision.detail)  # fmt: skip
            self._finish_with_abort(decision.request_id)
        else:
            if decision.request_id in self._streams:  # tokens past a gap came from the old incarnation
                self._streams[decision.request_id].drop_pending()
            messages.append((topics.PREFILL, self._migrated_request(decision)))
            self._migrations[decision.reason] += 1
            log.warning("request_migrated", id=decision.request_id, incarnation=decision.incarnation,
                        old_incarnation=old, reason=decision.reason, detail=decision.detail,
                        released_tokens=decision.offset, migration=decision.count)  # fmt: skip
        try:
            for topic, message in messages:
                await self.bus.publish(topic, message)
        except Exception as exc:  # the new incarnation may never start: fail rather than hang
            log.warning("request_migration_failed", id=decision.request_id, error=repr(exc))
            self._finish_with_abort(decision.request_id)

    def _migrated_request(self, migration: Migration) -> PrefillRequest:
        tracked = self._book.get(migration.request_id)
        assert tracked is not None, "the book returns migrations of tracked requests only"
        # Prompt scores come with the first token: once a token was released they were delivered, and
        # the new incarnation's prompt (original + released tokens) is not the one to score.
        scoring = None if tracked.released else tracked.request.sampling.prompt_logprobs
        sampling = dataclasses.replace(
            tracked.request.sampling, max_tokens=migration.max_tokens, prompt_logprobs=scoring
        )
        return PrefillRequest(
            request_id=migration.incarnation,
            model=tracked.request.model,
            prompt_token_ids=migration.prompt_token_ids,
            sampling=to_spec(sampling),
            arrival=tracked.arrival,  # keeps its age in the pool
            gateway_id=self.options.gateway_id,
        )

    def _finish_with_abort(self, request_id: str) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(TokenDelta(index=0, token_ids=(), finish_reason=FINISH_ABORT))
        self._streams.close(request_id)
        self._book.close(request_id)  # ended: nothing left to move


def token_delta(entry: TokenEntry) -> TokenDelta:
    logprobs: tuple[TokenLogprob, ...] = ()
    if entry.logprobs is not None:
        logprobs = _logprobs(entry.token_ids, entry.logprobs, entry.top_logprobs or ())
    reason = entry.finish_reason
    finish = (
        None
        if reason is None
        else (FINISH_ABORT if reason in (FinishReason.ABORT, FinishReason.ERROR) else str(reason))
    )
    return TokenDelta(
        index=entry.first_index,
        token_ids=entry.token_ids,
        logprobs=logprobs,
        finish_reason=finish,
    )


def prompt_delta(score: PromptScore, prompt_token_ids: tuple[int, ...]) -> TokenDelta:
    """A request's prompt logprobs as a delta with no tokens (the assembler takes them once)."""
    scored = _logprobs(prompt_token_ids[1:], score.logprobs, score.top_logprobs)
    return TokenDelta(index=0, token_ids=(), prompt_logprobs=scored)


def _logprobs(
    token_ids: tuple[int, ...], logprobs: tuple[float, ...], tops: tuple[TopLogprobs, ...]
) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token_id,
            logprob,
            tuple(zip(tops[i].token_ids, tops[i].logprobs, strict=True)) if i < len(tops) else (),
        )
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True))
    )
