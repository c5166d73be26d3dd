"""`alignedserve kvpool`: host-memory KV blocks behind a UCX endpoint, with a byte budget.

The memory is page-locked where torch sees a GPU in this process (`transfer.memory.pool_memory`), so
copies between it and a GPU are DMA; pageable otherwise (the CPU image carries no torch).

Prefill workers (and draining decode workers) push a request's KV here; staging prefill workers or decode
workers pull it. A push beyond the budget is refused (the sender backs off: backpressure, never OOM); an
entry is released once pulled and verified, or when the request is cancelled or finished.

The pool also keeps the announcements that made its entries batchable (`PoolIndex`, read from the batcher
topic in a group of its own) and publishes them again when a batcher (re)starts, so a batcher crash
loses no waiting request. Its heartbeat carries the bytes it holds and its budget (the gateway's gauge).

Every entry holds a lease (`Leases`): one not pulled within `lease_ttl_s` of being stored is freed, so a
request that will never be decoded cannot hold pool memory forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from alignedserve.bus import ConsumerOptions, Delivery, SeenIds, topics
from alignedserve.bus.messages import (
    Cancel,
    KvReady,
    Message,
    RequestFinished,
    ServiceKind,
    WorkerHeartbeat,
)
from alignedserve.kvpool.config import KvPoolSettings
from alignedserve.kvpool.index import PoolIndex, request_states
from alignedserve.service.entry import run_service
from alignedserve.service.logs import get_logger, request_context
from alignedserve.service.ops_metrics import register_transfer_metrics
from alignedserve.service.worker import WorkerRuntime
from alignedserve.transfer import KVRegistry, TransferEndpoint
from alignedserve.transfer.kv_store import KvStore, StoreSink
from alignedserve.transfer.leases import Leases, expire_leases
from alignedserve.transfer.memory import KvMemory, pool_memory

log = get_logger("alignedserve.kvpool")
ENDED_IDS = 100_000


class PoolStore(KvStore):
    """The pool's store: `on_release(key)` runs whenever an entry leaves it (pulled, replaced, dropped);
    a committed entry holds a lease until then.

    Entries are keyed by request id: their arrival and departure are logged under it, so a grep for a
    request finds where its KV waited."""

    def __init__(
        self,
        budget_bytes: int,
        on_release: Callable[[str], None],
        memory: KvMemory | None = None,
        leases: Leases | None = None,
    ) -> None:
        super().__init__(budget_bytes, memory, leases)
        self._on_release = on_release

    def commit(self, key: str) -> None:
        super().commit(key)
        with request_context(key):
            log.info("kv_stored", used_bytes=self.used_bytes)

    def release(self, key: str) -> bool:
        label = self.leases.label_of(key) if self.leases is not None else ""
        released = super().release(key)
        if released:
            with request_context(key, label):
                log.info("kv_released", used_bytes=self.used_bytes)
            self._on_release(key)
        return released


def pool_metrics(
    registry: CollectorRegistry, store: KvStore, index: PoolIndex
) -> tuple[Counter, Counter, Counter]:
    used = Gauge("alignedserve:kv_pool_used_bytes", "bytes of KV held in the pool", registry=registry)
    used.set_function(lambda: store.used_bytes)
    budget = Gauge("alignedserve:kv_pool_budget_bytes", "the pool's byte budget", registry=registry)
    budget.set(store.budget_bytes)
    usage = Gauge("alignedserve:kv_pool_usage_perc", "used / budget", registry=registry)
    usage.set_function(lambda: store.usage)
    entries = Gauge("alignedserve:kv_pool_entries", "requests whose KV is in the pool", registry=registry)
    entries.set_function(lambda: len(store))
    refusals = Gauge("alignedserve:kv_pool_refusals", "pushes refused for lack of room", registry=registry)
    refusals.set_function(lambda: store.refusals)
    announced = Gauge(
        "alignedserve:kv_pool_announced_entries",
        "entries announced to the batcher and not yet planned (re-announced to a restarted batcher)",
        registry=registry,
    )
    announced.set_function(lambda: len(index))
    stored = Counter("alignedserve:kv_pool_stored_total", "KV entries stored", registry=registry)
    reannounced = Counter(
        "alignedserve:kv_pool_reannounced_total",
        "KvReady re-sent to a (re)started batcher",
        registry=registry,
    )
    expired = Counter(
        "alignedserve:kv_pool_lease_expired_total",
        "entries freed because no one pulled them within the lease TTL",
        registry=registry,
    )
    return stored, reannounced, expired


def lease_expired(leases: Leases, expired: Counter) -> Callable[[str, str], None]:
    """What the pool does about an entry nobody pulled in time, before it frees it: says so."""

    def report(key: str, label: str) -> None:
        with request_context(key, label):
            log.warning("kv_lease_expired", ttl_s=leases.ttl_s)
        expired.inc()

    return report


def learn_labels(message: Message, leases: Leases) -> None:
    """The client's label of this pool's entries, from the announcements (the push carries none)."""
    for request_id, state in request_states(message):
        if leases.label(request_id, state.client_request_id) and isinstance(message, KvReady):
            with request_context(request_id, state.client_request_id):
                log.info("kv_announced", prefix_len=message.prefix_len)


async def serve(settings: KvPoolSettings) -> int:
    registry = CollectorRegistry()
    index = PoolIndex(settings.worker_id)
    leases = Leases(settings.lease_ttl_s)
    store = PoolStore(int(settings.pool_bytes), index.forget, pool_memory(), leases)
    stored, reannounced, expired = pool_metrics(registry, store, index)
    runtime = WorkerRuntime(ServiceKind.KVPOOL, settings, registry)
    runtime.kv_usage = lambda: (store.used_bytes, store.budget_bytes)
    served = KVRegistry()  # what the pool serves now: the entries an announcement may name
    ended = SeenIds(ENDED_IDS)  # requests cancelled or finished: a late push of theirs is not kept
    endpoint = TransferEndpoint(served, StoreSink(store, served, on_commit=stored.inc, cancelled=ended))
    register_transfer_metrics(registry, lambda: endpoint.client.stats)
    await runtime.start()
    try:

        async def on_batcher_topic(message: Message, _delivery: Delivery) -> None:
            index.on_batcher_topic(message, served)
            learn_labels(message, leases)

        async def on_event(message: Message) -> None:
            if isinstance(message, Cancel | RequestFinished):
                with request_context(message.request_id):
                    ended.add(message.request_id)
                    index.forget(message.request_id)
                    endpoint.registry.drop(message.request_id)
            elif isinstance(message, WorkerHeartbeat):
                again = index.on_heartbeat(message, served, time.time())
                if again:
                    await runtime.bus.publish_many(topics.BATCHER, again)
                    reannounced.inc(len(again))
                    log.info("reannounced_to_batcher", batcher=message.worker_id, requests=len(again))

        # A group of its own sees every message without taking any from the batcher's group. It reads from
        # now on, and before the address is advertised: no entry can be announced before it listens.
        group = f"kvpool-{settings.worker_id}-index"
        listening = await runtime.subscribe(
            topics.BATCHER, group, on_batcher_topic, ConsumerOptions(start="latest")
        )
        await listening.ready()
        await runtime.subscribe_events(on_event)
        address = await endpoint.start(settings.advertise_host, settings.transfer_port)
        runtime.ucx_address = address.to_bytes()
        runtime.spawn(expire_leases(leases, served, lease_expired(leases, expired)), "lease-expiry")
        runtime.set_ready()
        log.info(
            "kvpool_ready",
            ucx=address.to_wire(),
            budget_bytes=int(settings.pool_bytes),
            memory=store.memory.kind,
            lease_ttl_s=settings.lease_ttl_s,
        )
        await runtime.run_until_drained()
    finally:
        await endpoint.close()
        await runtime.close()
    return 0


def main(argv: list[str]) -> int:
    return run_service(KvPoolSettings, serve, argv, __doc__)
