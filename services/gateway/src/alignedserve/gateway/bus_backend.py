"""`BusBackend`: the disaggregated stack behind the gateway, reached over the control bus.

The I/O edge around three pure parts:
- `ClusterView` (cluster.py): worker liveness from heartbeats, decode status and kvpool usage. ready():
  the bus answers and a prefill and a decode worker sent a READY heartbeat lately; stats() from it;
- `TokenRouter` (routing.py): `TokenBatch` messages on this gateway's own topic become the deltas of
  each request, every output position once and in order, onto the request's queue;
- `MigrationDriver` (moves.py): a request whose KV is lost (`RequestLost`), or whose holding worker
  stops beating or restarts, is cancelled and prefilled again from its prompt plus the tokens already
  released, under a new incarnation id, at most `max_migrations` times (the decisions: migration.py).
submit publishes `PrefillRequest` on the prefill topic; cancel publishes `Cancel` on the events topic,
which every service reads (blocks are freed everywhere). This gateway beats on the events topic too. A
cancel never fails the client's close: one that finds every bus connection busy is sent from the
background once one frees (`BUSY_RETRY`), so the workers still stop early.

Bus writes go through a bounded number of slots (`max_publishes`, below the bus's connection pool): a
burst of requests waits for a slot instead of opening a connection each, and a request that cannot get
one within `publish_wait_s` — or whose publish finds every pooled connection busy (`BusPoolTimeout`) — is
refused with `BackendBusy` (the gateway's 429), never a 500.

Broker loss: a subscription that finds the broker lost its data (restarted without storage, flushed)
tells this backend, which migrates every unfinished request (what it published may be gone); a broker
that stays away longer than a publish rides out (`BusUnavailable` on this gateway's heartbeat) ends
every in-flight request with an error instead of leaving its client waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from alignedserve.bus import (
    Bus,
    BusPoolTimeout,
    BusUnavailable,
    ConsumerOptions,
    Delivery,
    Subscription,
    make_bus,
    topics,
)
from alignedserve.bus.messages import (
    Cancel,
    DecodeStatus,
    Message,
    PrefillRequest,
    RequestFinished,
    RequestLost,
    ServiceKind,
    TokenBatch,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.core.retry import Backoff, retrying
from alignedserve.gateway.backend import (
    BackendBusy,
    BackendError,
    BackendStats,
    BackendUnavailable,
    GenerationRequest,
    TokenDelta,
)
from alignedserve.gateway.cluster import ClusterView
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.migration import GiveUp, MigrationBook
from alignedserve.gateway.moves import MigrationDriver, Move
from alignedserve.gateway.routing import Routed, TokenRouter
from alignedserve.service.logs import get_logger
from alignedserve.service.sampling import to_spec

log = get_logger(__name__)

# the subscriptions of one gateway each notice one broker loss: one migration of everything per loss
BUS_LOSS_QUIET_S = 5.0
# a background publish (a deferred cancel) that found every bus connection busy is tried again on this
# back-off, for up to BUSY_DEADLINE_S; each try itself waits the pool's timeout for a connection first
BUSY_RETRY = Backoff(0.05, max_s=1.0)
BUSY_DEADLINE_S = 60.0


@dataclass(frozen=True)
class BusBackendOptions:
    gateway_id: str = "gateway"  # names this gateway's token topic; unique per gateway process
    worker_timeout_s: float = 15.0  # a worker counts as alive this long after its last heartbeat
    require_workers: bool = True  # ready() needs a live prefill and decode worker
    heartbeat_interval_s: float = 2.0  # how often this gateway announces itself on the events topic
    max_migrations: int = 3  # re-prefills of one request whose KV or worker was lost, then it fails
    watch_interval_s: float = 0.5  # how often silent workers are looked for (their requests migrate)
    # the bus's connection pool is bounded (Redis: `max_connections`, 64 by default); the gateway's three
    # readers and its heartbeat take a few, so 32 concurrent writes stay inside it.
    max_publishes: int = 32
    publish_wait_s: float = 5.0  # a new request waits this long for a write slot, then gets its 429
    kv_block_size: int = 16  # tokens per KV block in the decode workers (their engine's default)

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> BusBackendOptions:
        return cls(
            gateway_id=settings.gateway_id,
            worker_timeout_s=settings.worker_timeout_s,
            max_migrations=settings.max_migrations,
            max_publishes=settings.bus_max_publishes,
            publish_wait_s=settings.bus_wait_timeout_s,
        )


class BusBackend:
    """GenerationBackend over the control bus (see module docstring)."""

    def __init__(self, bus: Bus, options: BusBackendOptions | None = None) -> None:
        self.bus = bus
        self.options = options or BusBackendOptions()
        book = MigrationBook(self.options.max_migrations)
        self.cluster = ClusterView()
        self.router = TokenRouter(book)
        self.driver = MigrationDriver(book, self.options.gateway_id)
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._subscriptions: list[Subscription] = []
        self._connected = False
        self._tasks: list[asyncio.Task[None]] = []
        self._beat_seq = 0
        self._started_at = time.time()
        self._write_slots = asyncio.Semaphore(self.options.max_publishes)
        self._bus_lost_at = float("-inf")  # monotonic time of the last broker loss acted on
        self._redoing: set[asyncio.Task[None]] = set()  # migrations after a broker loss, under way

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
        reads = [
            (self.token_topic, f"gateway-{gateway_id}"),
            (topics.EVENTS, gateway_id),
            (topics.BATCHER, f"gateway-{gateway_id}-status"),
        ]
        latest = ConsumerOptions(start="latest", on_broker_loss=self._on_broker_loss)
        self._subscriptions = [
            await self.bus.subscribe(
                topic, group=group, consumer=gateway_id, handler=self._on_message, options=latest
            )
            for topic, group in reads
        ]
        for subscription in self._subscriptions:
            await subscription.ready()
        self._connected = True
        self._tasks = [
            asyncio.create_task(self._beat_forever(), name="gateway-heartbeat"),
            asyncio.create_task(self._watch_forever(), name="gateway-worker-watch"),
        ]
        log.info("bus_backend_started", bus=self.bus.url, token_topic=self.token_topic)

    async def close(self) -> None:
        self._connected = False
        for task in reversed(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._tasks:
            with contextlib.suppress(Exception):  # best effort: the broker may be gone already
                await self._beat(WorkerState.STOPPED)
        self._tasks = []
        for work in list(self._redoing):
            work.cancel()
        for request_id in list(self._queues):
            self._abort(request_id)
        for subscription in self._subscriptions:
            await subscription.stop()
        self._subscriptions = []
        await self.bus.close()

    def ready(self) -> bool:
        if not self._connected or not all(s.running for s in self._subscriptions):
            return False
        return not self.options.require_workers or self.cluster.serving(
            time.monotonic(), self.options.worker_timeout_s
        )

    def stats(self) -> BackendStats:
        return self.cluster.stats(time.monotonic(), self.options.worker_timeout_s, len(self._queues))

    def kv_capacity_tokens(self) -> int:
        """Tokens the live decode workers' KV caches hold (admission's default budget); 0 while unknown."""
        blocks = self.cluster.decode_capacity_blocks(time.monotonic(), self.options.worker_timeout_s)
        return blocks * self.options.kv_block_size

    def migration_counts(self) -> dict[str, int]:
        """Migrations so far by reason (the gateway's `request_migrations_total` counter)."""
        return dict(self.driver.counts)

    # --- requests ---------------------------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if not self._connected:
            raise BackendError("the bus backend is not connected")
        arrival = time.time()
        try:
            self.router.open(request, arrival)
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[request.request_id] = queue
        message = PrefillRequest(
            request_id=request.request_id,
            model=request.model,
            prompt_token_ids=request.prompt_token_ids,
            sampling=to_spec(request.sampling),
            arrival=arrival,
            gateway_id=self.options.gateway_id,
            client_request_id=request.client_request_id,
        )
        try:
            await self._publish(topics.PREFILL, message, self.options.publish_wait_s)
        except BackendBusy:
            self._forget(request.request_id)
            raise
        except BusPoolTimeout as exc:
            self._forget(request.request_id)
            raise BackendBusy(str(exc)) from None
        except BusUnavailable as exc:
            self._forget(request.request_id)
            raise BackendUnavailable(f"the control bus does not answer: {exc}") from None
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
        """Publish `Cancel` for the request's current incarnation; never raises. Every connection busy:
        it is sent from the background once one frees. Any other failure (the broker gone past a
        publish's ride-out) is logged: the workers then run the request to its end."""
        incarnation = self.router.book.incarnation(request_id) or request_id  # the id the stack knows now
        self._forget(request_id)
        cancel = Cancel(request_id=incarnation, reason="client disconnected")
        try:
            await self._publish(topics.EVENTS, cancel)
        except BusPoolTimeout as exc:
            log.warning("cancel_deferred", id=request_id, incarnation=incarnation, error=str(exc))
            self._background(self._publish_quietly(topics.EVENTS, cancel))
        except Exception as exc:
            log.warning("cancel_failed", id=request_id, incarnation=incarnation, error=repr(exc))

    async def _publish(self, topic: str, message: Message, wait_s: float | None = None) -> None:
        """Publish through a write slot; `wait_s` bounds the wait for one (None: as long as it takes)."""
        try:
            await asyncio.wait_for(self._write_slots.acquire(), wait_s)
        except TimeoutError:
            raise BackendBusy(f"no bus write slot within {wait_s} s") from None
        try:
            await self.bus.publish(topic, message)
        finally:
            self._write_slots.release()

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.router.close(request_id)

    def _abort(self, request_id: str) -> None:
        self._deliver([self.router.abort(request_id)])

    def _deliver(self, routed: list[Routed]) -> None:
        for request_id, delta in routed:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(delta)

    # --- consumed messages --------------------------------------------------------------------------------

    async def _on_message(self, message: Message, _delivery: Delivery) -> None:
        if isinstance(message, TokenBatch):
            self._deliver(self.router.on_tokens(message))
        elif isinstance(message, RequestFinished):
            self._on_finished(message)
        elif isinstance(message, RequestLost):
            await self._apply(self.driver.lost(message))
        elif isinstance(message, Cancel):
            await self._apply(self.driver.cancelled(message))
        elif isinstance(message, WorkerHeartbeat):
            if self.cluster.heartbeat(message, time.monotonic()):
                await self._apply(self.driver.restarted(message.worker_id))
        elif isinstance(message, DecodeStatus):
            self.cluster.status(message)
        else:
            self.router.on_placed(message)

    def _on_finished(self, finished: RequestFinished) -> None:
        request_id = self.router.failed(finished)
        if request_id is not None and request_id in self._queues:
            log.warning("request_failed_in_stack", id=request_id, incarnation=finished.request_id,
                        reason=finished.finish_reason, error=finished.error)  # fmt: skip
            self._abort(request_id)

    # --- background: this gateway's heartbeat, the sweep for silent workers ---------------------------

    async def _beat_forever(self) -> None:
        """Workers learn of this gateway (and that its token topic has a reader) from these beats."""
        while True:
            try:
                await self._beat(WorkerState.READY)
            except BusUnavailable as exc:  # gone longer than a publish rides out: nothing reaches us
                log.warning("heartbeat_failed", error=repr(exc))
                self._fail_in_flight(f"the control bus is unavailable: {exc}")
            except Exception as exc:  # a broker hiccup must not end the heartbeats
                log.warning("heartbeat_failed", error=repr(exc))
            await asyncio.sleep(self.options.heartbeat_interval_s)

    def _fail_in_flight(self, why: str) -> None:
        """End every in-flight request with an error (their stack-side state is cancelled once the
        broker is back: each Cancel waits in a publish of its own)."""
        if not self._queues:
            return
        log.warning("requests_failed_bus_unavailable", requests=len(self._queues), error=why)
        for request_id in list(self._queues):
            incarnation = self.router.book.incarnation(request_id) or request_id
            self._abort(request_id)
            cancel = Cancel(request_id=incarnation, reason="the control bus was unavailable")
            self._background(self._publish_quietly(topics.EVENTS, cancel))

    def _on_broker_loss(self, what: str) -> None:
        """A subscription found the broker's data gone: once per loss, every unfinished request moves."""
        now = time.monotonic()
        if now - self._bus_lost_at < BUS_LOSS_QUIET_S:
            return
        self._bus_lost_at = now
        log.warning("bus_data_lost", detail=what, requests=len(self._queues))
        self._background(self._apply(self.driver.bus_lost(what)))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._redoing.add(task)
        task.add_done_callback(self._redoing.discard)

    async def _publish_quietly(self, topic: str, message: Message) -> None:
        """A publish nobody waits for: a busy pool is waited out (`BUSY_RETRY`), a failure is logged."""
        try:
            async for attempt in retrying(BUSY_RETRY, on=BusPoolTimeout, deadline_s=BUSY_DEADLINE_S):
                with attempt:
                    await self._publish(topic, message)
        except Exception as exc:
            log.warning("publish_failed", topic=topic, type=message.TYPE, error=repr(exc))

    async def _beat(self, state: WorkerState) -> None:
        self._beat_seq += 1
        beat = WorkerHeartbeat(kind=ServiceKind.GATEWAY, worker_id=self.options.gateway_id, state=state,
                               seq=self._beat_seq, started_at=self._started_at)  # fmt: skip
        await self._publish(topics.EVENTS, beat)

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.watch_interval_s)
            try:
                silent = self.cluster.dead(time.monotonic(), self.options.worker_timeout_s)
                await self._apply(self.driver.sweep(silent))
            except Exception as exc:  # a broker hiccup must not end the watch
                log.warning("worker_watch_failed", error=repr(exc))

    async def _apply(self, moves: list[Move]) -> None:
        """Carry out each move: cancel the old incarnation everywhere, then prefill the new one."""
        for move in moves:
            decision = move.decision
            if isinstance(decision, GiveUp):
                log.warning("request_migrations_exhausted", id=decision.request_id,
                            incarnation=decision.incarnation, migrations=decision.count,
                            reason=decision.reason, detail=decision.detail)  # fmt: skip
                self._abort(decision.request_id)
            else:
                self.router.moved(decision.request_id)
                log.warning("request_migrated", id=decision.request_id, incarnation=decision.incarnation,
                            old_incarnation=decision.old_incarnation, reason=decision.reason,
                            detail=decision.detail, released_tokens=decision.offset,
                            migration=decision.count)  # fmt: skip
            try:
                for topic, message in move.publish:
                    await self._publish(topic, message)
            except Exception as exc:  # the new incarnation may never start: fail rather than hang
                log.warning("request_migration_failed", id=decision.request_id, error=repr(exc))
                self._abort(decision.request_id)
