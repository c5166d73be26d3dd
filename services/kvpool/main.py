"""`alignedserve kvpool`: host-memory KV blocks behind a UCX endpoint, with a byte budget.

Prefill workers (and draining decode workers) push a request's KV here; staging prefill workers or decode
workers pull it. A push beyond the budget is refused (the sender backs off: backpressure, never OOM); an
entry is released once pulled and verified, or when the request is cancelled or finished.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from alignedserve.bus import SeenIds
from alignedserve.bus.messages import Cancel, Message, RequestFinished, ServiceKind
from alignedserve.transfer import KVRegistry, TransferEndpoint
from alignedserve_services.common.entry import run_service
from alignedserve_services.common.kv_store import KvStore, StoreSink
from alignedserve_services.common.logs import get_logger
from alignedserve_services.common.worker import WorkerRuntime
from alignedserve_services.kvpool.config import KvPoolSettings

log = get_logger("alignedserve.kvpool")
ENDED_IDS = 100_000


def pool_metrics(registry: CollectorRegistry, store: KvStore) -> Counter:
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
    return Counter("alignedserve:kv_pool_stored_total", "KV entries stored", registry=registry)


async def serve(settings: KvPoolSettings) -> int:
    registry = CollectorRegistry()
    store = KvStore(int(settings.pool_bytes))
    stored = pool_metrics(registry, store)
    runtime = WorkerRuntime(ServiceKind.KVPOOL, settings, registry)
    served = KVRegistry()
    ended = SeenIds(ENDED_IDS)  # requests cancelled or finished: a late push of theirs is not kept
    endpoint = TransferEndpoint(served, StoreSink(store, served, on_commit=stored.inc, cancelled=ended))
    await runtime.start()
    try:
        address = await endpoint.start(settings.advertise_host, settings.transfer_port)
        runtime.ucx_address = address.to_bytes()

        async def on_event(message: Message) -> None:
            if isinstance(message, Cancel | RequestFinished):
                ended.add(message.request_id)
                endpoint.registry.drop(message.request_id)

        await runtime.subscribe_events(on_event)
        runtime.set_ready()
        log.info("kvpool_ready", ucx=address.to_wire(), budget_bytes=int(settings.pool_bytes))
        await runtime.run_until_drained()
    finally:
        await endpoint.close()
        await runtime.close()
    return 0


def main(argv: list[str]) -> int:
    return run_service(KvPoolSettings, serve, argv, __doc__)
