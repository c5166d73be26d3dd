"""Overload at the gateway over real Redis: 300 concurrent chat requests on one box end as 200s and 429s
(with Retry-After and an OpenAI error body), never a 5xx, and the gateway stays ready after.

The test plays the prefill and decode workers (as test_gateway_bus_backend.py does): it answers every
PrefillRequest with a short finished token batch. Before the bus writes were bounded, such a burst opened
one Redis connection per request and 200 of 300 failed with redis-py's MaxConnectionsError as HTTP 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis_databases

from alignedserve.bus import Bus, BusPoolTimeout, ConsumerOptions, Delivery, connect_bus, topics
from alignedserve.bus.messages import (
    Cancel,
    FinishReason,
    Message,
    PrefillRequest,
    ServiceKind,
    TokenBatch,
    TokenEntry,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.core.sampling import SamplingParams
from alignedserve.gateway.app import create_app
from alignedserve.gateway.backend import BackendBusy, GenerationRequest
from alignedserve.gateway.bus_backend import BusBackend, BusBackendOptions
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.tokenizer import PromptTokenizer
from alignedserve.service.http import HttpServer

CONCURRENT = 300
TINY_POOL = "max_connections=4&pool_timeout_ms=1"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


class AnsweringWorkers:
    """Answers every PrefillRequest of one gateway at once with `answer` and a finish."""

    def __init__(self, bus: Bus, gateway_id: str, answer: tuple[int, ...]) -> None:
        self.bus = bus
        self.gateway_id = gateway_id
        self.answer = answer

    async def on_message(self, message: Message, _delivery: Delivery) -> None:
        if isinstance(message, PrefillRequest) and message.gateway_id == self.gateway_id:
            entry = TokenEntry(
                request_id=message.request_id,
                first_index=0,
                token_ids=self.answer,
                finish_reason=FinishReason.LENGTH,
            )
            batch = TokenBatch(worker_id="decode-0", iteration=0, entries=(entry,))
            await self.bus.publish(topics.tokens(self.gateway_id), batch)

    async def beat_forever(self) -> None:
        while True:
            for kind, name in ((ServiceKind.PREFILL, "prefill-0"), (ServiceKind.DECODE, "decode-0")):
                beat = WorkerHeartbeat(kind=kind, worker_id=name, state=WorkerState.READY, seq=1)
                await self.bus.publish(topics.EVENTS, beat)
            await asyncio.sleep(1.0)


def _private_db(url: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{redis_databases.OVERLOAD}"))


@pytest.fixture
async def gateway(
    redis_url: str, smollm2_tokenizer: PromptTokenizer
) -> AsyncIterator[tuple[httpx.AsyncClient, BusBackend]]:
    url = _private_db(redis_url)
    async with serving_gateway(url, url, smollm2_tokenizer) as served:
        yield served


@asynccontextmanager
async def serving_gateway(
    url: str, gateway_url: str, smollm2_tokenizer: PromptTokenizer
) -> AsyncIterator[tuple[httpx.AsyncClient, BusBackend]]:
    """The gateway on `gateway_url` (its bus options), answered by workers played on `url`."""
    gateway_id = f"gw-{uuid.uuid4().hex[:8]}"
    workers_bus = await connect_bus(url)
    answer = tuple(smollm2_tokenizer.encode_text(" Paris.")[:3])
    workers = AnsweringWorkers(workers_bus, gateway_id, answer)
    prefill = await workers_bus.subscribe(
        topics.PREFILL,
        group=f"prefill-{gateway_id}",
        consumer="p0",
        handler=workers.on_message,
        options=ConsumerOptions(start="latest"),
    )
    await prefill.ready()
    beats = asyncio.create_task(workers.beat_forever())
    backend = BusBackend.from_url(gateway_url, BusBackendOptions(gateway_id=gateway_id))
    settings = GatewaySettings(model="smollm2", backend="bus", bus=gateway_url, gateway_id=gateway_id)
    server = HttpServer(create_app(settings, backend, smollm2_tokenizer), "127.0.0.1", 0)
    # A connection per request, none kept alive: a request sent on a kept-alive connection just as the
    # server closes it for idling (uvicorn: 5 s) fails with ReadError before the server sees it, which
    # a test of what the server answers must not count.
    limits = httpx.Limits(max_connections=CONCURRENT + 10, max_keepalive_connections=0)
    try:  # a failed test still stops what it started: left running, the event loop's close waits on it
        await backend.start()
        await server.start()
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0, limits=limits) as client:
            yield client, backend
    finally:
        await server.stop()
        await backend.close()
        beats.cancel()
        await prefill.stop()
        await workers_bus.delete_topics(
            topics.tokens(gateway_id), topics.PREFILL, topics.EVENTS, topics.BATCHER
        )
        await workers_bus.close()


async def _until_ready(client: httpx.AsyncClient) -> None:
    for _ in range(300):
        if (await client.get("/ready")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway never became ready")


async def test_300_concurrent_chat_requests_get_200_or_429_never_5xx(
    gateway: tuple[httpx.AsyncClient, BusBackend],
) -> None:
    client, _ = gateway
    await _until_ready(client)
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    responses = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=body) for _ in range(CONCURRENT))
    )
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] > 0
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "rate_limit_error"
        else:
            assert response.json()["choices"][0]["finish_reason"] == "length"
    assert (await client.get("/ready")).status_code == 200
    after = await client.post("/v1/chat/completions", json=body)
    assert after.status_code == 200, after.text


async def test_a_tiny_bus_connection_pool_answers_429_never_5xx(
    redis_url: str, smollm2_tokenizer: PromptTokenizer
) -> None:
    """The gateway's Redis pool has a connection for each of its three readers and one to share
    (`max_connections=4`), and a call waits 1 ms for one: 300 concurrent requests contend for it, those
    that find it taken are refused with 429 (BusPoolTimeout), the rest are answered."""
    url = _private_db(redis_url)
    async with serving_gateway(url, f"{url}?{TINY_POOL}", smollm2_tokenizer) as (client, _backend):
        await _until_ready(client)
        body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
        responses = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body) for _ in range(CONCURRENT))
        )
        statuses = Counter(r.status_code for r in responses)
        assert set(statuses) == {200, 429}, statuses
        refused = [r for r in responses if r.status_code == 429]
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in refused)
        pool = [r for r in refused if "Redis connections stayed busy" in r.json()["error"]["message"]]
        assert pool, [r.json()["error"]["message"] for r in refused[:3]]
        await _until_ready(client)  # the readers that lost their connection for a moment are back


async def test_a_cancel_that_finds_every_bus_connection_busy_is_sent_once_one_frees(
    redis_url: str, smollm2_tokenizer: PromptTokenizer
) -> None:
    """A client leaves while the gateway's tiny pool is exhausted: its cancel returns at once (the
    client's close never fails with BusPoolTimeout) and the Cancel reaches the workers once a
    connection frees, so they stop the request instead of running it to max_tokens."""
    url = _private_db(redis_url)
    async with serving_gateway(url, f"{url}?{TINY_POOL}", smollm2_tokenizer) as (client, backend):
        await _until_ready(client)
        cancels: asyncio.Queue[str] = asyncio.Queue()

        async def on_event(message: Message, _delivery: Delivery) -> None:
            if isinstance(message, Cancel):
                cancels.put_nowait(message.request_id)

        watcher = await connect_bus(url)
        events = await watcher.subscribe(topics.EVENTS, group=f"watch-{uuid.uuid4().hex[:8]}",
                                         consumer="w", handler=on_event,
                                         options=ConsumerOptions(start="latest"))  # fmt: skip
        await events.ready()
        request = _burst(1)[0]
        await backend.submit(request)
        pool = backend.bus._redis.connection_pool  # type: ignore[attr-defined]  # the gateway's own
        held = []
        try:
            with pytest.raises(BusPoolTimeout):  # the test takes every connection, readers' included
                for _ in range(100):
                    held.append(await pool.get_connection())
            async with asyncio.timeout(5):
                await backend.cancel(request.request_id)  # returns, deferred: nothing can be sent now
            assert cancels.empty()
        finally:
            for connection in held:
                await pool.release(connection)
        try:
            async with asyncio.timeout(20):
                while (await cancels.get()) != request.request_id:
                    pass
        finally:
            await events.stop()
            await watcher.close()


def _burst(count: int) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=3)
    return [
        GenerationRequest(f"burst-{uuid.uuid4().hex}", "smollm2", (1, 2, 3), params, time.monotonic())
        for _ in range(count)
    ]


async def test_a_burst_of_submits_shares_the_bounded_write_slots(
    gateway: tuple[httpx.AsyncClient, BusBackend],
) -> None:
    """300 requests submitted at once (no HTTP or tokenizing to pace them): each waits for a write slot
    rather than opening a Redis connection of its own, and every one is answered."""
    client, backend = gateway
    await _until_ready(client)
    streams = await asyncio.gather(*(backend.submit(request) for request in _burst(CONCURRENT)))
    async with asyncio.timeout(60):  # a lost answer fails here rather than waiting forever
        finished = [[delta async for delta in stream][-1].finish_reason for stream in streams]
    assert finished == ["length"] * CONCURRENT


async def test_a_request_that_gets_no_write_slot_in_time_is_busy_not_failed(
    gateway: tuple[httpx.AsyncClient, BusBackend],
) -> None:
    client, backend = gateway
    await _until_ready(client)
    slots = backend._write_slots  # the test holds every slot, as a stuck burst would
    for _ in range(backend.options.max_publishes):
        await slots.acquire()
    try:
        narrow = dataclasses.replace(backend.options, publish_wait_s=0.05)
        backend.options = narrow
        with pytest.raises(BackendBusy):
            await backend.submit(_burst(1)[0])
        body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 3}
        refused = await client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        for _ in range(backend.options.max_publishes):
            slots.release()
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


async def _pool_beat(backend: BusBackend, workers_bus: Bus, seq: int, used: int) -> None:
    beat = WorkerHeartbeat(
        kind=ServiceKind.KVPOOL,
        worker_id="kvpool-0",
        state=WorkerState.READY,
        seq=seq,
        kv_used_bytes=used,
        kv_capacity_bytes=1000,
    )
    await workers_bus.publish(topics.EVENTS, beat)
    for _ in range(200):
        if abs(backend.stats().kv_pool_usage - used / 1000) < 1e-9:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the gateway never heard the kvpool's heartbeat")


async def test_a_full_kv_pool_refuses_new_choices_with_429(
    gateway: tuple[httpx.AsyncClient, BusBackend], redis_url: str
) -> None:
    """A request of two choices: the first is admitted (nothing else is), the second finds the pool at
    99% and the whole request is a 429; once the pool has room both are admitted."""
    client, backend = gateway
    await _until_ready(client)
    workers_bus = await connect_bus(_private_db(redis_url))
    try:
        body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 3, "n": 2, "seed": 1}
        await _pool_beat(backend, workers_bus, seq=1, used=990)
        refused = await client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert "KV pool is full" in refused.json()["error"]["message"]
        await _pool_beat(backend, workers_bus, seq=2, used=100)
        admitted = await client.post("/v1/chat/completions", json=body)
        assert admitted.status_code == 200, admitted.text
    finally:
        await workers_bus.close()
