"""The gateway over a real bus (Redis Streams and Kafka): the test plays the prefill and decode workers.

It reads the PrefillRequest the gateway publishes, answers with TokenBatch messages the way workers do
(first token from prefill, then per-iteration batches from decode, with redelivered and out-of-order
entries), and checks what the client gets: every token once, in order, the right text and usage. A
request whose KV is lost (RequestLost) or whose worker stops beating is re-prefilled under a new id, and
the client still gets one continuous answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis_databases

from alignedserve.bus import Bus, ConsumerOptions, Delivery, connect_bus, topics
from alignedserve.bus.messages import (
    Cancel,
    DecodeStatus,
    FinishReason,
    Message,
    PrefillRequest,
    RequestFinished,
    RequestLost,
    ServiceKind,
    TokenBatch,
    TokenEntry,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.gateway.app import create_app
from alignedserve.gateway.bus_backend import BusBackend, BusBackendOptions
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.tokenizer import PromptTokenizer
from alignedserve.service.http import HttpServer

ANSWER = " Paris is the capital of France."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _private_db(url: str) -> str:
    """Redis: a database of our own, so no other prefill consumer on the shared server sees our requests."""
    parts = urlsplit(url)
    return (
        urlunsplit(parts._replace(path=f"/{redis_databases.GATEWAY_BUS_BACKEND}"))
        if parts.scheme.startswith("redis")
        else url
    )


class FakeWorkers:
    """The test's side of the bus: collects what the gateway publishes, publishes what workers would."""

    def __init__(self, bus: Bus, gateway_id: str) -> None:
        self.bus = bus
        self.gateway_id = gateway_id
        self.prefill_requests: asyncio.Queue[PrefillRequest] = asyncio.Queue()
        self.cancels: asyncio.Queue[Cancel] = asyncio.Queue()
        self.gateway_beats: asyncio.Queue[WorkerHeartbeat] = asyncio.Queue()

    async def on_message(self, message: Message, _delivery: Delivery) -> None:
        if isinstance(message, PrefillRequest) and message.gateway_id == self.gateway_id:
            await self.prefill_requests.put(message)
        elif isinstance(message, Cancel):
            await self.cancels.put(message)
        elif isinstance(message, WorkerHeartbeat) and message.kind is ServiceKind.GATEWAY:
            await self.gateway_beats.put(message)

    async def heartbeat(
        self,
        kind: ServiceKind,
        worker_id: str,
        state: WorkerState = WorkerState.READY,
        started_at: float = 0.0,
    ) -> None:
        beat = WorkerHeartbeat(kind=kind, worker_id=worker_id, state=state, seq=1, started_at=started_at)
        await self.bus.publish(topics.EVENTS, beat)

    async def tokens(self, worker_id: str, iteration: int, *entries: TokenEntry) -> None:
        batch = TokenBatch(worker_id=worker_id, iteration=iteration, entries=entries)
        await self.bus.publish(topics.tokens(self.gateway_id), batch)


@pytest.fixture
def worker_timeout_s() -> float:
    """The gateway's heartbeat horizon (a test that kills a worker parametrizes a short one)."""
    return 30.0


@pytest.fixture
async def stack(
    bus_url: str, smollm2_tokenizer: PromptTokenizer, worker_timeout_s: float
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeWorkers, BusBackend]]:
    url = _private_db(bus_url)
    gateway_id = f"gw-{uuid.uuid4().hex[:8]}"
    workers_bus = await connect_bus(url)
    workers = FakeWorkers(workers_bus, gateway_id)
    listen = ConsumerOptions(start="latest")
    subscriptions = [
        await workers_bus.subscribe(
            topics.PREFILL,
            group=f"prefill-{gateway_id}",
            consumer="p0",
            handler=workers.on_message,
            options=listen,
        ),
        await workers_bus.subscribe(
            topics.EVENTS,
            group=f"events-{gateway_id}",
            consumer="w0",
            handler=workers.on_message,
            options=listen,
        ),
    ]
    for subscription in subscriptions:
        await subscription.ready()
    options = BusBackendOptions(
        gateway_id=gateway_id, worker_timeout_s=worker_timeout_s, watch_interval_s=0.2
    )
    backend = BusBackend.from_url(url, options)
    await backend.start()
    settings = GatewaySettings(model="smollm2", backend="bus", bus=url, gateway_id=gateway_id)
    server = HttpServer(create_app(settings, backend, smollm2_tokenizer), "127.0.0.1", 0)
    await server.start()
    async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as client:
        yield client, workers, backend
    await server.stop()
    await backend.close()
    for subscription in subscriptions:
        await subscription.stop()
    doomed = [topics.tokens(gateway_id)]
    if url != bus_url:  # our private Redis database: drop the shared streams and their per-test groups too
        doomed += [topics.PREFILL, topics.EVENTS, topics.BATCHER]
    await workers_bus.delete_topics(*doomed)
    await workers_bus.close()


async def _until_ready(client: httpx.AsyncClient) -> None:
    for _ in range(300):
        if (await client.get("/ready")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway never became ready")


async def _make_ready(client: httpx.AsyncClient, workers: FakeWorkers) -> None:
    assert (await client.get("/ready")).status_code == 503  # no workers known yet
    await workers.heartbeat(ServiceKind.PREFILL, "prefill-0")
    await workers.heartbeat(ServiceKind.DECODE, "decode-0")
    await _until_ready(client)


def _entry(
    request_id: str, ids: list[int], first: int, end: int, finish: FinishReason | None = None
) -> TokenEntry:
    return TokenEntry(
        request_id=request_id, first_index=first, token_ids=tuple(ids[first:end]), finish_reason=finish
    )


async def test_chat_through_the_bus_with_redelivered_and_reordered_tokens(
    stack: tuple[httpx.AsyncClient, FakeWorkers, BusBackend], smollm2_tokenizer: PromptTokenizer
) -> None:
    client, workers, _ = stack
    await _make_ready(client, workers)
    beat = await asyncio.wait_for(workers.gateway_beats.get(), 30)
    assert (beat.worker_id, beat.state) == (workers.gateway_id, WorkerState.READY)
    answer_ids = smollm2_tokenizer.encode_text(ANSWER)[:8]
    expected_text = smollm2_tokenizer.tokenizer.decode(answer_ids)
    body = {
        "model": "smollm2",
        "messages": MESSAGES,
        "max_tokens": len(answer_ids),
        "temperature": 0,
        "stream": True,
    }
    response_task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await asyncio.wait_for(workers.prefill_requests.get(), 30)
    assert request.prompt_token_ids == tuple(smollm2_tokenizer.encode_chat(MESSAGES))
    assert (request.sampling.max_tokens, request.sampling.temperature, request.model) == (
        len(answer_ids),
        0.0,
        "smollm2",
    )
    rid, ids = request.request_id, answer_ids
    await workers.tokens("prefill-0", 0, _entry(rid, ids, 0, 1))  # first token from prefill
    await workers.tokens("decode-0", 1, _entry(rid, ids, 3, 5))  # arrives ahead of a gap
    await workers.tokens("decode-0", 2, _entry(rid, ids, 1, 3))  # fills it
    await workers.tokens("decode-0", 2, _entry(rid, ids, 1, 3))  # a redelivered copy
    await workers.tokens("decode-0", 3, _entry(rid, ids, 4, len(ids), FinishReason.LENGTH))  # overlaps
    response = await asyncio.wait_for(response_task, 30)
    assert response.status_code == 200
    events = [json.loads(b.removeprefix("data: ")) for b in response.text.split("\n\n")[:-2]]
    assert response.text.endswith("data: [DONE]\n\n")
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert content == expected_text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_cancel_on_disconnect_and_failure_from_the_stack(
    stack: tuple[httpx.AsyncClient, FakeWorkers, BusBackend], smollm2_tokenizer: PromptTokenizer
) -> None:
    client, workers, _ = stack
    await _make_ready(client, workers)
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 50}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}):
        request = await asyncio.wait_for(workers.prefill_requests.get(), 30)
    cancel = await asyncio.wait_for(workers.cancels.get(), 30)
    assert cancel.request_id == request.request_id
    # A request the stack gives up on (RequestFinished with an error) fails with a 500, not a hang.
    failing = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await asyncio.wait_for(workers.prefill_requests.get(), 30)
    finished = RequestFinished(
        request_id=request.request_id, worker_id="decode-0", finish_reason=FinishReason.ERROR,
        prompt_tokens=len(request.prompt_token_ids), completion_tokens=0, error="KV lost",
    )  # fmt: skip
    await workers.bus.publish(topics.tokens(workers.gateway_id), finished)
    response = await asyncio.wait_for(failing, 30)
    assert response.status_code == 500 and "aborted" in response.json()["error"]["message"]


async def test_decode_status_feeds_the_gauges_and_draining_workers_unready(
    stack: tuple[httpx.AsyncClient, FakeWorkers, BusBackend],
) -> None:
    client, workers, backend = stack
    await _make_ready(client, workers)
    status = DecodeStatus(
        worker_id="decode-0",
        seq=1,
        free_blocks=25,
        total_blocks=100,
        running=3,
        prefix_lo=100,
        prefix_hi=140,
        idle=False,
    )
    await workers.bus.publish(topics.BATCHER, status)
    for _ in range(300):
        if backend.stats().num_requests_running == 3:
            break
        await asyncio.sleep(0.05)
    metrics = (await client.get("/metrics")).text
    assert 'alignedserve:decode_kv_usage_perc{model_name="smollm2"} 0.75' in metrics
    assert 'alignedserve:num_requests_running{model_name="smollm2"} 3.0' in metrics
    await workers.heartbeat(ServiceKind.DECODE, "decode-0", WorkerState.DRAINING)
    for _ in range(300):
        if (await client.get("/ready")).status_code == 503:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway stayed ready without a live decode worker")


BODY = {"model": "smollm2", "prompt": "The capital of France", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stream": True}  # fmt: skip


class Reader:
    """A streamed completion read as it arrives: the text so far, the finish reason, the usage."""

    def __init__(self, client: httpx.AsyncClient, body: dict[str, object]) -> None:
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, int] = {}
        self.task = asyncio.create_task(self._read(client, body))

    async def _read(self, client: httpx.AsyncClient, body: dict[str, object]) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                self.usage = event.get("usage") or self.usage
                for choice in event["choices"]:
                    self.text += choice["text"]
                    self.finish_reason = choice["finish_reason"] or self.finish_reason

    async def until_text(self, text: str) -> None:
        for _ in range(600):
            if self.text == text:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the client got {self.text!r}, not {text!r}")


async def _next_for(workers: FakeWorkers, request_id: str) -> PrefillRequest:
    """The next PrefillRequest whose id starts with `request_id` (other requests' are put back)."""
    for _ in range(20):
        request = await asyncio.wait_for(workers.prefill_requests.get(), 30)
        if request.request_id.startswith(request_id):
            return request
        await workers.prefill_requests.put(request)
        await asyncio.sleep(0.05)
    raise AssertionError(f"no PrefillRequest for {request_id}")


async def _cancel_of(workers: FakeWorkers, request_id: str) -> Cancel:
    for _ in range(50):
        cancel = await asyncio.wait_for(workers.cancels.get(), 30)
        if cancel.request_id == request_id:
            return cancel
    raise AssertionError(f"no Cancel for {request_id}")


async def test_a_request_whose_kv_is_lost_is_re_prefilled_and_the_client_sees_one_stream(
    stack: tuple[httpx.AsyncClient, FakeWorkers, BusBackend], smollm2_tokenizer: PromptTokenizer
) -> None:
    client, workers, _ = stack
    await _make_ready(client, workers)
    ids = smollm2_tokenizer.encode_text(ANSWER)  # 7 tokens
    decode = smollm2_tokenizer.tokenizer.decode
    body = {"model": "smollm2", "prompt": "The capital of France", "max_tokens": len(ids), "temperature": 0,
            "top_k": 5, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    reader = Reader(client, body)
    first = await _next_for(workers, "cmpl-")
    rid = first.request_id
    await workers.tokens("prefill-0", 0, _entry(rid, ids, 0, 1))
    await workers.tokens("decode-0", 1, _entry(rid, ids, 1, 3))
    await workers.tokens("decode-0", 2, _entry(rid, ids, 4, 5))  # past a gap: not released yet
    await reader.until_text(decode(ids[:3]))
    lost = RequestLost(request_id=rid, worker_id="decode-0", reason="KV pull failed: peer holds no KV")
    await workers.bus.publish(topics.EVENTS, lost)
    again = await _next_for(workers, rid)
    assert again.request_id == f"{rid}-m1"
    assert again.prompt_token_ids == (*first.prompt_token_ids, *ids[:3])
    assert again.sampling == dataclasses.replace(first.sampling, max_tokens=len(ids) - 3)
    assert (again.arrival, again.gateway_id) == (first.arrival, first.gateway_id)
    await _cancel_of(workers, rid)  # the old incarnation is freed everywhere
    await workers.bus.publish(topics.EVENTS, lost)  # a redelivered copy moves nothing
    new = again.request_id
    await workers.tokens("decode-0", 3, _entry(rid, [0] * 8, 3, 4))  # a stale copy: ignored
    await workers.tokens("prefill-0", 0, TokenEntry(request_id=new, first_index=0, token_ids=(ids[3],)))
    await workers.tokens("decode-1", 1, TokenEntry(request_id=new, first_index=1, token_ids=tuple(ids[4:]),
                                                   finish_reason=FinishReason.LENGTH))  # fmt: skip
    await asyncio.wait_for(reader.task, 30)
    assert reader.text == decode(ids) and reader.finish_reason == "length"
    prompt_tokens = len(first.prompt_token_ids)
    assert reader.usage == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "total_tokens": prompt_tokens + len(ids),
    }
    metrics = (await client.get("/metrics")).text
    assert 'alignedserve:request_migrations_total{model_name="smollm2",reason="kv_lost"} 1.0' in metrics
    assert workers.prefill_requests.empty()


async def test_a_live_request_a_decode_worker_cancelled_for_a_gone_gateway_moves(
    stack: tuple[httpx.AsyncClient, FakeWorkers, BusBackend], smollm2_tokenizer: PromptTokenizer
) -> None:
    """A decode worker that took this gateway for gone (its beats held up) cancels its requests; the
    gateway is alive after all, so each continues under a new incarnation instead of hanging."""
    client, workers, _ = stack
    await _make_ready(client, workers)
    ids = smollm2_tokenizer.encode_text(ANSWER)
    body = {"model": "smollm2", "prompt": "The capital of France", "max_tokens": len(ids), "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    reader = Reader(client, body)
    first = await _next_for(workers, "cmpl-")
    rid = first.request_id
    await workers.tokens("prefill-0", 0, _entry(rid, ids, 0, 1))
    await reader.until_text(smollm2_tokenizer.tokenizer.decode(ids[:1]))
    await workers.bus.publish(topics.EVENTS, Cancel(request_id=rid, reason="gateway gateway-t silent"))
    again = await _next_for(workers, rid)
    assert again.request_id == f"{rid}-m1" and again.prompt_token_ids == (*first.prompt_token_ids, ids[0])
    new = again.request_id
    await workers.tokens("decode-0", 1, TokenEntry(request_id=new, first_index=0, token_ids=tuple(ids[1:]),
                                                   finish_reason=FinishReason.LENGTH))  # fmt: skip
    await asyncio.wait_for(reader.task, 30)
    assert reader.text == smollm2_tokenizer.tokenizer.decode(ids)
    metrics = (await client.get("/metrics")).text
    assert (
        'alignedserve:request_migrations_total{model_name="smollm2",reason="cancelled_elsewhere"} 1.0'
        in metrics
    )


async def _beat_forever(workers: FakeWorkers, *who: tuple[ServiceKind, str]) -> None:
    while True:
        for kind, worker_id in who:
            await workers.heartbeat(kind, worker_id)
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def _live_cluster(client: httpx.AsyncClient, workers: FakeWorkers) -> AsyncIterator[None]:
    """prefill-0 and decode-0 beat every 0.2 s, and the gateway is ready, while the block runs."""
    live = asyncio.create_task(
        _beat_forever(workers, (ServiceKind.PREFILL, "prefill-0"), (ServiceKind.DECODE, "decode-0"))
    )
    try:
        await _until_ready(client)
        yield
    finally:
        live.cancel()


@pytest.mark.parametrize("worker_timeout_s", [1.0])
async def test_requests_of_a_silent_or_restarted_worker_move_and_those_of_a_stopped_one_do_not(
    stack: tuple[httpx.AsyncClient, FakeWorkers, BusBackend], smollm2_tokenizer: PromptTokenizer
) -> None:
    client, workers, _ = stack
    async with _live_cluster(client, workers):
        ids = smollm2_tokenizer.encode_text(ANSWER)[:6]
        decode = smollm2_tokenizer.tokenizer.decode
        # one at a time: concurrent requests may reach the bus in any order, and each reader must know its id
        killed = Reader(client, BODY)
        a = await _next_for(workers, "cmpl-")
        stopped = Reader(client, BODY)
        b = await _next_for(workers, "cmpl-")
        restarted = Reader(client, BODY)
        c = await _next_for(workers, "cmpl-")
        await workers.heartbeat(ServiceKind.DECODE, "decode-1")  # then killed: never beats again
        await workers.heartbeat(ServiceKind.DECODE, "decode-2")  # drained: hands its requests back
        await workers.heartbeat(ServiceKind.DECODE, "decode-3", started_at=100.0)
        await workers.tokens("decode-1", 1, _entry(a.request_id, ids, 0, 2))
        await workers.tokens("decode-2", 1, _entry(b.request_id, ids, 0, 2))
        await workers.tokens("decode-3", 1, _entry(c.request_id, ids, 0, 3))
        await workers.heartbeat(ServiceKind.DECODE, "decode-2", WorkerState.STOPPED)
        for reader, n in ((killed, 2), (stopped, 2), (restarted, 3)):
            await reader.until_text(decode(ids[:n]))
        await workers.heartbeat(ServiceKind.DECODE, "decode-3", started_at=200.0)  # killed and back at once
        c_moved = await _next_for(workers, c.request_id)
        assert (
            c_moved.prompt_token_ids == (*c.prompt_token_ids, *ids[:3]) and c_moved.sampling.max_tokens == 3
        )
        moved = await _next_for(workers, a.request_id)  # decode-1 silent for 1 s: its request moves
        assert moved.request_id == f"{a.request_id}-m1"
        assert moved.prompt_token_ids == (*a.prompt_token_ids, *ids[:2]) and moved.sampling.max_tokens == 4
        await _cancel_of(workers, a.request_id)
        await asyncio.sleep(0.6)  # three more sweeps: decode-2 stopped gracefully, its request stays
        assert workers.prefill_requests.empty()
        await workers.tokens("decode-0", 2, TokenEntry(request_id=moved.request_id, first_index=0,
                                                       token_ids=tuple(ids[2:]), finish_reason=FinishReason.LENGTH))  # fmt: skip
        await workers.tokens("decode-0", 2, _entry(b.request_id, ids, 2, 6, FinishReason.LENGTH))
        await workers.tokens("decode-3", 3, TokenEntry(request_id=c_moved.request_id, first_index=0,
                                                       token_ids=tuple(ids[3:]), finish_reason=FinishReason.LENGTH))  # fmt: skip
        for reader in (killed, stopped, restarted):
            await asyncio.wait_for(reader.task, 30)
            assert reader.text == decode(ids) and reader.finish_reason == "length"
        metrics = (await client.get("/metrics")).text
        assert (
            'alignedserve:request_migrations_total{model_name="smollm2",reason="worker_died"} 2.0' in metrics
        )


@pytest.mark.parametrize("worker_timeout_s", [1.0])
async def test_a_request_not_prefilled_yet_moves_when_a_prefill_worker_dies(
    stack: tuple[httpx.AsyncClient, FakeWorkers, BusBackend], smollm2_tokenizer: PromptTokenizer
) -> None:
    client, workers, _ = stack
    async with _live_cluster(client, workers):
        ids = smollm2_tokenizer.encode_text(ANSWER)[:6]
        reader = Reader(client, BODY)
        first = await _next_for(workers, "cmpl-")
        await workers.heartbeat(ServiceKind.PREFILL, "prefill-1")  # took it, then died: no token ever
        moved = await _next_for(workers, first.request_id)
        assert moved.request_id == f"{first.request_id}-m1"
        assert (moved.prompt_token_ids, moved.sampling) == (first.prompt_token_ids, first.sampling)
        await _cancel_of(workers, first.request_id)
        await workers.tokens("prefill-0", 0, _entry(moved.request_id, ids, 0, 6, FinishReason.LENGTH))
        await asyncio.wait_for(reader.task, 30)
        assert reader.text == smollm2_tokenizer.tokenizer.decode(ids) and reader.finish_reason == "length"
        metrics = (await client.get("/metrics")).text
        assert (
            'alignedserve:request_migrations_total{model_name="smollm2",reason="prefill_died"} 1.0' in metrics
        )
