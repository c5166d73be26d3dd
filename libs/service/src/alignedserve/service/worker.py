"""What every back-end worker (prefill, kvpool, batcher, decode) does besides its own job.

`WorkerRuntime` connects the bus, serves /health, /ready and /metrics, publishes a `WorkerHeartbeat`
every `HEARTBEAT_S` on the events topic (the first one registers the worker; it carries the UCX address
of a worker that holds KV, and the KV bytes it holds when the service set `kv_usage`), reads the events
topic in a consumer group of its own, and drains on SIGTERM:
/ready turns 503, the heartbeat says DRAINING, subscriptions finish their message in hand, in-flight work
(`drain.track()`) completes, then everything closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import CollectorRegistry

from alignedserve.bus import (
    Bus,
    BusUnavailable,
    ConsumerOptions,
    Delivery,
    Handler,
    Subscription,
    connect_bus,
    topics,
)
from alignedserve.bus.messages import Message, ServiceKind, WorkerHeartbeat, WorkerState
from alignedserve.core.config import WorkerSettings
from alignedserve.service.drain import Drain
from alignedserve.service.http import HttpServer, ops_app
from alignedserve.service.logs import get_logger
from alignedserve.service.ops_metrics import BusMetrics

HEARTBEAT_S = 1.0
log = get_logger(__name__)

EventHandler = Callable[[Message], Awaitable[None]]
KvUsage = Callable[[], tuple[int, int]]  # -> (KV bytes held now, KV byte budget)


class WorkerRuntime:
    def __init__(self, kind: ServiceKind, settings: WorkerSettings, registry: CollectorRegistry) -> None:
        self.kind = kind
        self.settings = settings
        self.worker_id = settings.worker_id
        self.registry = registry
        self.bus_metrics = BusMetrics(registry)
        self.drain = Drain(settings.drain_timeout_s)
        self.ucx_address = b""
        self.kv_usage: KvUsage | None = None  # read at every beat (kvpool: its store's bytes)
        self._ready = False
        self._bus: Bus | None = None
        self._server: HttpServer | None = None
        self._subscriptions: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0
        self._started_at = time.time()

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError("WorkerRuntime.start() has not run")
        return self._bus

    def set_ready(self, ready: bool = True) -> None:
        self._ready = ready

    def is_ready(self) -> bool:
        return self._ready and not self.drain.draining

    async def start(self) -> None:
        """Health endpoints first (liveness during a long model load), then the bus and the heartbeat."""
        self.drain.install_signal_handlers()
        app = ops_app(self.kind.value, self.is_ready, self.registry, self.drain)
        self._server = HttpServer(app, self.settings.metrics_host, self.settings.metrics_port)
        await self._server.start()
        try:
            self._bus = await connect_bus(self.settings.bus, self.settings.deployment)
        except BusUnavailable as exc:  # e.g. a broker that wants a password this worker lacks
            log.error("bus_unavailable", error=str(exc))
            raise
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))

    async def subscribe(
        self,
        topic_names: str | Sequence[str],
        group: str,
        handler: Handler,
        options: ConsumerOptions | None = None,
    ) -> Subscription:
        sub = await self.bus.subscribe(
            topic_names,
            group=group,
            consumer=self.worker_id,
            handler=handler,
            options=self.bus_metrics.options(group, options),
        )
        self.bus_metrics.track(group, sub)
        self._subscriptions.append(sub)
        return sub

    async def subscribe_events(self, on_event: EventHandler) -> Subscription:
        """The broadcast topic, in a group of this worker's own (new messages only)."""

        async def handle(message: Message, _delivery: Delivery) -> None:
            await on_event(message)

        options = ConsumerOptions(start="latest")
        return await self.subscribe(topics.EVENTS, f"events-{self.worker_id}", handle, options)

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        """A background loop of the service; an exception in it is logged and stops the worker."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker_loop_crashed", loop=name)
                self.drain.begin()

        self._tasks.append(asyncio.create_task(guarded(), name=name))

    async def run_until_drained(self) -> None:
        await self.drain.wait_begun()
        self._ready = False
        try:
            await self._beat(WorkerState.DRAINING)
        except Exception as exc:  # a broker that is down must not keep in-flight work from finishing
            log.warning("heartbeat_failed", error=repr(exc))
        await asyncio.gather(*(sub.stop() for sub in self._subscriptions))
        await self.drain.wait_idle()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._bus is not None:
            with contextlib.suppress(Exception):
                await self._beat(WorkerState.STOPPED)
            await self._bus.close()
        if self._server is not None:
            await self._server.stop()

    async def _heartbeat_loop(self) -> None:
        while True:
            state = WorkerState.READY if self.is_ready() else WorkerState.STARTING
            if self.drain.draining:
                state = WorkerState.DRAINING
            try:
                await self._beat(state)
            except Exception as exc:  # the broker may restart: keep beating
                log.warning("heartbeat_failed", error=repr(exc))
            await asyncio.sleep(HEARTBEAT_S)

    async def _beat(self, state: WorkerState) -> None:
        self._seq += 1
        used, capacity = self.kv_usage() if self.kv_usage is not None else (0, 0)
        beat = WorkerHeartbeat(
            kind=self.kind,
            worker_id=self.worker_id,
            state=state,
            seq=self._seq,
            ucx_address=self.ucx_address,
            http_url=self._server.url if self._server is not None else "",
            started_at=self._started_at,
            kv_used_bytes=used,
            kv_capacity_bytes=capacity,
        )
        await self.bus.publish(topics.EVENTS, beat)
