"""The gateway's KV pool gauge over a real Redis bus: kvpool heartbeats carry the bytes each pool holds and
its budget; the gateway reports sum(held) / sum(budget) over the live pools, in `stats()` and on /metrics
as `alignedserve:kv_pool_usage_perc`. Redis database 10; worker ids of this test only."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis_databases

from alignedserve.bus import Bus, connect_bus, topics
from alignedserve.bus.messages import ServiceKind, WorkerHeartbeat, WorkerState
from alignedserve.gateway.app import create_app
from alignedserve.gateway.bus_backend import BusBackend, BusBackendOptions
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.tokenizer import PromptTokenizer
from alignedserve.service.http import HttpServer

DB = redis_databases.POOL_USAGE
GAUGE = 'alignedserve:kv_pool_usage_perc{model_name="smollm2"}'


def _db(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{DB}"))


class Gateway:
    def __init__(self, backend: BusBackend, client: httpx.AsyncClient, bus: Bus, tag: str) -> None:
        self.backend = backend
        self.client = client
        self.bus = bus
        self.tag = tag  # names this test's pools
        self._seq = 0

    async def pool_beat(
        self, name: str, used: int, capacity: int, state: WorkerState = WorkerState.READY
    ) -> None:
        self._seq += 1
        beat = WorkerHeartbeat(kind=ServiceKind.KVPOOL, worker_id=f"{name}-{self.tag}", state=state,
                               seq=self._seq, started_at=1.0, kv_used_bytes=used, kv_capacity_bytes=capacity)  # fmt: skip
        await self.bus.publish(topics.EVENTS, beat)

    async def usage_becomes(self, value: float) -> None:
        for _ in range(300):
            if self.backend.stats().kv_pool_usage == pytest.approx(value):
                break
            await asyncio.sleep(0.05)
        assert self.backend.stats().kv_pool_usage == pytest.approx(value)
        scraped = (await self.client.get("/metrics")).text
        line = next(line for line in scraped.splitlines() if line.startswith(GAUGE))
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(value)


@pytest.fixture
async def gateway(redis_url: str, smollm2_tokenizer: PromptTokenizer) -> AsyncIterator[Gateway]:
    url = _db(redis_url)
    tag = uuid.uuid4().hex[:8]
    gateway_id = f"gw-{tag}"
    backend = BusBackend.from_url(url, BusBackendOptions(gateway_id=gateway_id, worker_timeout_s=30.0))
    await backend.start()
    settings = GatewaySettings(model="smollm2", backend="bus", bus=url, gateway_id=gateway_id)
    server = HttpServer(create_app(settings, backend, smollm2_tokenizer), "127.0.0.1", 0)
    await server.start()
    bus = await connect_bus(url)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as client:
            yield Gateway(backend, client, bus, tag)
    finally:
        await bus.delete_topics(topics.tokens(gateway_id))
        await bus.close()
        await server.stop()
        await backend.close()


async def test_kv_pool_usage_is_held_over_budget_across_the_live_pools(gateway: Gateway) -> None:
    await gateway.usage_becomes(0.0)  # no pool has reported
    await gateway.pool_beat("kvpool-a", used=10 << 20, capacity=100 << 20)
    await gateway.pool_beat("kvpool-b", used=290 << 20, capacity=300 << 20)
    await gateway.usage_becomes(0.75)  # (10 + 290) / (100 + 300)
    await gateway.pool_beat("kvpool-a", used=60 << 20, capacity=100 << 20)  # a later beat replaces it
    await gateway.usage_becomes(0.875)
    await gateway.pool_beat("kvpool-b", used=0, capacity=300 << 20, state=WorkerState.STOPPED)
    await gateway.usage_becomes(0.6)  # only kvpool-a is live
    await gateway.pool_beat("kvpool-a", used=60 << 20, capacity=100 << 20, state=WorkerState.DRAINING)
    await gateway.usage_becomes(0.0)  # no live pool left
