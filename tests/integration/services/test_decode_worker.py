"""The decode worker as it runs in production (`serve`: WorkerRuntime, real Redis bus, UCX endpoint, the
engine on a tiny random-weight Llama), fed by real peers: a kvpool store behind a UCX endpoint, a
staging endpoint with a candidate request buffer, and a prefill engine that exports KV the way the
prefill worker does. Greedy tokens must equal a single engine's; every test ends with SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from alignedserve.bus import Delivery, connect_bus, topics
from alignedserve.bus.base import Bus
from alignedserve.bus.messages import (
    BatchPlan,
    Cancel,
    CandidateBuffer,
    DecodeStatus,
    FinishReason,
    KvLocation,
    Message,
    PlannedRequest,
    PrefetchDone,
    RequestEvicted,
    RequestFinished,
    RequestLost,
    RequestState,
    SamplingSpec,
    ServiceKind,
    TokenBatch,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.core.sampling import SamplingParams
from alignedserve.decode.config import DecodeSettings
from alignedserve.decode.main import main, serve
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_envelope import KvEnvelope
from alignedserve.engine.loader import LoadedModel
from alignedserve.transfer import KVRegistry, TransferEndpoint
from alignedserve.transfer.kv_store import KvStore, StoreSink
from alignedserve.transfer.memory import TorchMemory

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 4
TINY_LLAMA = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    eos_token_id=2,
    bos_token_id=1,
)
WAIT_S = 60.0
M = TypeVar("M", bound=Message)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY_LLAMA).eval()
    model.generation_config.eos_token_id = 2
    return LoadedModel(model, None, model.config, "tiny", 0.0, False)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def prefix(monkeypatch: pytest.MonkeyPatch) -> str:
    """Topics of this test only: other tests and services on the same Redis never see them."""
    name = f"test-decode-{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(topics, "PREFIX", name)
    monkeypatch.setattr(topics, "BATCHER", f"{name}.batcher")
    monkeypatch.setattr(topics, "EVENTS", f"{name}.events")
    return name


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


@dataclass
class Inbox:
    """Everything published on the topics the test watches, in arrival order."""

    messages: list[Message] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, message: Message, _delivery: Delivery) -> None:
        self.messages.append(message)
        self.arrived.set()

    def of(self, kind: type[M]) -> list[M]:
        return [m for m in self.messages if isinstance(m, kind)]

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; got {self.messages[-5:]}")
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), 1.0)


class Peers:
    """A kvpool (store + endpoint), a staging worker's endpoint (its candidate request buffer takes
    pushes), a prefill engine that exports KV like the prefill worker, and the test's view of the bus."""

    def __init__(self, bus: Bus, tiny: LoadedModel, gateway: str) -> None:
        self.bus = bus
        self.gateway = gateway
        self.prefill_engine = LLMEngine(EngineConfig(model="tiny", block_size=BLOCK, num_blocks=1024), tiny)
        self.pool_store = KvStore(64 << 20)
        pool_served = KVRegistry()
        self.pool = TransferEndpoint(pool_served, StoreSink(self.pool_store, pool_served))
        self.stage_store = KvStore(64 << 20, TorchMemory("cpu"))  # as the prefill worker builds it
        self.stage_served = KVRegistry()
        self.stage = TransferEndpoint(self.stage_served, StoreSink(self.stage_store, self.stage_served))
        self.inbox = Inbox()
        self.first_tokens: dict[str, int] = {}
        self.prompt_lens: dict[str, int] = {}

    async def start(self) -> None:
        pool = await self.pool.start()
        stage = await self.stage.start()
        self.pool_location = KvLocation(
            worker_id="kvpool-t", kind=ServiceKind.KVPOOL, ucx_address_key=pool.to_wire()
        )
        self.stage_location = KvLocation(worker_id="prefill-t", kind=ServiceKind.PREFILL, ucx_address_key=stage.to_wire())  # fmt: skip
        watched = [topics.tokens(self.gateway), topics.BATCHER, topics.EVENTS, topics.staging("prefill-t")]
        self.subscription = await self.bus.subscribe(
            watched, group="test", consumer="test", handler=self.inbox.handle
        )

    async def close(self) -> None:
        await self.subscription.stop()
        await self.pool.close()
        await self.stage.close()

    async def prefill(self, rid: str, prompt: list[int], spec: SamplingSpec, staged: bool) -> PlannedRequest:
        """Prefill, export, and put the KV in the pool (pushed) or in the staging buffer (published)."""
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=spec.ignore_eos)
        [out] = self.prefill_engine.prefill([(rid, prompt, params)])
        kv = self.prefill_engine.export_kv(rid)
        envelope = KvEnvelope(kv.header, tuple(prompt), tuple(out.output_token_ids))
        if staged:
            self.stage_served.publish(rid, envelope.to_bytes(), kv.payload, checksum=kv.header.checksum)
        else:
            await self.pool.push(
                self.pool.address, rid, envelope.to_bytes(), kv.payload, checksum=kv.header.checksum
            )
        self.prefill_engine.free(rid)
        self.first_tokens[rid] = out.output_token_ids[0]
        self.prompt_lens[rid] = len(prompt)
        state = RequestState(gateway_id=self.gateway, sampling=spec, prompt_len=len(prompt), output_len=1,
                             recent_token_ids=tuple(out.output_token_ids))  # fmt: skip
        return PlannedRequest(request_id=rid, prefix_len=kv.header.num_tokens, blocks=-(-kv.header.num_tokens // BLOCK),
                              location=self.pool_location, state=state, arrival=time.time())  # fmt: skip

    def outputs(self) -> dict[str, list[int]]:
        """What a gateway reassembles: the prefill's first token at index 0, then each position once."""
        by_request: dict[str, dict[int, int]] = {rid: {0: t} for rid, t in self.first_tokens.items()}
        for batch in self.inbox.of(TokenBatch):
            for entry in batch.entries:
                for offset, token in enumerate(entry.token_ids):
                    seen = by_request[entry.request_id].setdefault(entry.first_index + offset, token)
                    assert seen == token, f"{entry.request_id}: position {entry.first_index + offset} changed"
        return {rid: [tokens[i] for i in range(len(tokens))] for rid, tokens in by_request.items()}

    def finished(self, worker_id: str) -> dict[str, RequestFinished]:
        return {m.request_id: m for m in self.inbox.of(RequestFinished) if m.worker_id == worker_id}

    def lost(self, worker_id: str) -> dict[str, RequestLost]:
        return {m.request_id: m for m in self.inbox.of(RequestLost) if m.worker_id == worker_id}

    def heartbeats(self, worker_id: str) -> list[WorkerHeartbeat]:
        return [m for m in self.inbox.of(WorkerHeartbeat) if m.worker_id == worker_id]

    def statuses(self, worker_id: str) -> list[DecodeStatus]:
        return [m for m in self.inbox.of(DecodeStatus) if m.worker_id == worker_id]


@dataclass
class Worker:
    settings: DecodeSettings
    task: asyncio.Task[int]


@pytest.fixture
def bus_url(redis_url: str) -> str:
    """Short XREADGROUP blocks: subscriptions stop quickly at the end of each test."""
    return f"{redis_url}{'&' if '?' in redis_url else '?'}block_ms=100"


@pytest.fixture
async def peers(prefix: str, bus_url: str, tiny: LoadedModel) -> AsyncIterator[Peers]:
    bus = await connect_bus(bus_url)
    peers = Peers(bus, tiny, gateway=f"gw-{uuid.uuid4().hex[:6]}")
    await peers.start()
    yield peers
    await peers.close()
    watched = [topics.tokens(peers.gateway), topics.BATCHER, topics.EVENTS, topics.staging("prefill-t")]
    await bus.delete_topics(*watched, topics.decode("decode-t"))
    await bus.close()


async def start_worker(peers: Peers, bus_url: str, tiny: LoadedModel, **knobs: object) -> Worker:
    # float32: `tiny` is loaded in float32 and the tests compare tokens exactly
    options: dict[str, object] = dict(worker_id="decode-t", bus=bus_url, model="tiny", dtype="float32",
                                      block_size=BLOCK, num_kv_blocks=256, max_num_seqs=8, metrics_port=0,
                                      status_interval_s=0.1, log_level="warning")  # fmt: skip
    options.update(knobs)
    settings = DecodeSettings(**options)  # type: ignore[arg-type]
    task = asyncio.create_task(serve(settings, loaded=tiny))
    await peers.inbox.until(
        lambda: bool(peers.statuses("decode-t")) or task.done(), "the worker's first status"
    )
    assert not task.done(), task.exception()
    return Worker(settings, task)


async def stop_worker(worker: Worker) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # the worker's own drain handler takes it
    assert await asyncio.wait_for(worker.task, WAIT_S) == 0


async def metrics_text(peers: Peers) -> str:
    """The worker's /metrics, found through its heartbeat (its HTTP server runs on this event loop)."""
    await peers.inbox.until(lambda: bool(peers.heartbeats("decode-t")), "a heartbeat")
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{peers.heartbeats('decode-t')[0].http_url}/metrics")).text


def reference(
    tiny: LoadedModel, batch: list[list[int]], max_tokens: int, ignore_eos: bool
) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model="tiny", block_size=BLOCK, num_blocks=1024), tiny)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return [o.output_token_ids for o in engine.generate(batch, params)]


async def publish_plan(
    peers: Peers, batch_id: int, requests: list[PlannedRequest], staging: str = ""
) -> BatchPlan:
    plan = BatchPlan(batch_id=batch_id, decode_worker_id="decode-t", staging_worker_id=staging,
                     buffer=CandidateBuffer.BATCH, requests=tuple(requests))  # fmt: skip
    await peers.bus.publish(topics.decode("decode-t"), plan)
    return plan


async def test_a_batch_from_the_pool_decodes_exactly_like_one_engine(peers: Peers, bus_url: str, tiny: LoadedModel) -> None:  # fmt: skip
    batch = prompts([5, 17, 33, 9], seed=1)
    want = reference(tiny, batch, max_tokens=12, ignore_eos=False)
    worker = await start_worker(peers, bus_url, tiny)
    spec = SamplingSpec(max_tokens=12, temperature=0.0)
    planned = [await peers.prefill(f"r{i}", p, spec, staged=False) for i, p in enumerate(batch)]
    await publish_plan(peers, 7, planned)  # prefetch off: decode pulls from the pool itself
    await peers.inbox.until(lambda: len(peers.finished("decode-t")) == 4, "4 finished requests")
    assert peers.outputs() == {f"r{i}": w for i, w in enumerate(want)}
    for rid, done in peers.finished("decode-t").items():
        assert (
            done.completion_tokens == len(want[int(rid[1:])]) and done.prompt_tokens == peers.prompt_lens[rid]
        )
        assert done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    await peers.inbox.until(lambda: peers.statuses("decode-t")[-1].idle, "an idle status")
    last = peers.statuses("decode-t")[-1]
    assert last.latest_batch_id == 7 and last.free_blocks == last.total_blocks == 256
    assert len(peers.pool_store) == 0  # each entry released once pulled
    metrics = await metrics_text(peers)
    assert 'alignedserve:decode_admitted_requests_total{source="batch"} 4.0' in metrics
    assert "alignedserve:decode_admission_stall_seconds_count 1.0" in metrics
    assert 'alignedserve:decode_kv_pulled_bytes_total{when="admission"}' in metrics
    await stop_worker(worker)


async def test_with_prefetch_from_pool_waiting_candidates_are_pulled_from_the_pool_ahead(peers: Peers, bus_url: str, tiny: LoadedModel) -> None:  # fmt: skip
    """`up --prefetch decode` (CPU engines' `auto`): no staging worker, and the candidates that wait for a
    slot have their KV pulled from the pool while the running rows decode."""
    batch = prompts([6, 19, 11, 27], seed=3)
    want = reference(tiny, batch, max_tokens=16, ignore_eos=True)
    worker = await start_worker(peers, bus_url, tiny, max_num_seqs=2, prefetch_from_pool=True)
    spec = SamplingSpec(max_tokens=16, temperature=0.0, ignore_eos=True)
    planned = [await peers.prefill(f"p{i}", p, spec, staged=False) for i, p in enumerate(batch)]
    await publish_plan(peers, 9, planned)  # two run at once: the other two wait as candidates
    await peers.inbox.until(lambda: len(peers.finished("decode-t")) == 4, "4 finished requests")
    assert peers.outputs() == {f"p{i}": w for i, w in enumerate(want)}
    assert len(peers.pool_store) == 0
    metrics = await metrics_text(peers)
    assert 'alignedserve:decode_kv_pulled_bytes_total{when="prefetch"}' in metrics  # ahead of admission
    await stop_worker(worker)


async def test_with_prefetch_from_pool_a_plan_is_pulled_when_it_arrives_not_at_admission(peers: Peers, bus_url: str, tiny: LoadedModel) -> None:  # fmt: skip
    """A worker with free slots admits a plan at its next iteration. The plan's KV is pulled as soon as
    the plan arrives (during a step, on a busy worker), so admission only imports it: no byte is pulled
    at admission, with the engine idle."""
    batch = prompts([7, 21, 13], seed=4)
    want = reference(tiny, batch, max_tokens=10, ignore_eos=True)
    worker = await start_worker(peers, bus_url, tiny, prefetch_from_pool=True)
    spec = SamplingSpec(max_tokens=10, temperature=0.0, ignore_eos=True)
    planned = [await peers.prefill(f"q{i}", p, spec, staged=False) for i, p in enumerate(batch)]
    await publish_plan(peers, 13, planned)
    await peers.inbox.until(lambda: len(peers.finished("decode-t")) == 3, "3 finished requests")
    assert peers.outputs() == {f"q{i}": w for i, w in enumerate(want)}
    metrics = await metrics_text(peers)
    assert 'alignedserve:decode_admitted_requests_total{source="batch"} 3.0' in metrics
    assert 'alignedserve:decode_kv_pulled_bytes_total{when="prefetch"}' in metrics
    assert 'decode_kv_pulled_bytes_total{when="admission"}' not in metrics
    await stop_worker(worker)


async def test_staged_batch_with_evictions_to_the_staging_buffer_still_decodes_exactly(peers: Peers, bus_url: str, tiny: LoadedModel) -> None:  # fmt: skip
    batch = prompts([10, 11, 12, 13, 9, 14], seed=2)
    want = reference(tiny, batch, max_tokens=20, ignore_eos=True)
    # 24 blocks of 4 tokens cannot hold six requests growing to ~33 tokens: the scheduler must evict
    worker = await start_worker(peers, bus_url, tiny, num_kv_blocks=24)
    spec = SamplingSpec(max_tokens=20, temperature=0.0, ignore_eos=True)
    planned = [await peers.prefill(f"s{i}", p, spec, staged=True) for i, p in enumerate(batch)]
    await publish_plan(peers, 11, planned, staging="prefill-t")
    done = PrefetchDone(batch_id=11, staging_worker_id="prefill-t", decode_worker_id="decode-t",
                        buffer=CandidateBuffer.BATCH, ready=tuple(r.request_id for r in planned),
                        location=peers.stage_location)  # fmt: skip
    await peers.bus.publish(topics.decode("decode-t"), done)
    await peers.inbox.until(lambda: len(peers.finished("decode-t")) == 6, "6 finished requests")
    assert peers.outputs() == {f"s{i}": w for i, w in enumerate(want)}
    evicted = peers.inbox.of(RequestEvicted)
    assert evicted and all(
        e.to is CandidateBuffer.REQUESTS and e.location == peers.stage_location for e in evicted
    )
    assert all(e.batch_id == 11 and e.prefix_len > e.state.prompt_len for e in evicted)
    assert len(peers.stage_served) == 0 and len(peers.stage_store) == 0  # every pushed-back KV pulled again
    metrics = await metrics_text(peers)
    assert (
        'alignedserve:decode_kv_pulled_bytes_total{when="prefetch"}' in metrics
    )  # pre-pulled before admission
    assert 'alignedserve:decode_evicted_requests_total{to="prefill"}' in metrics
    await stop_worker(worker)


async def test_a_failed_prefetch_loses_the_request_and_a_cancel_frees_the_blocks(peers: Peers, bus_url: str, tiny: LoadedModel) -> None:  # fmt: skip
    worker = await start_worker(peers, bus_url, tiny)
    spec = SamplingSpec(max_tokens=1000, temperature=0.0, ignore_eos=True)
    planned = [await peers.prefill(rid, p, spec, staged=True) for rid, p in zip(["ok", "lost"], prompts([8, 8], 3), strict=True)]  # fmt: skip
    await publish_plan(peers, 21, planned, staging="prefill-t")
    await peers.bus.publish(topics.decode("decode-t"), PrefetchDone(
        batch_id=21, staging_worker_id="prefill-t", decode_worker_id="decode-t", buffer=CandidateBuffer.BATCH,
        ready=("ok",), failed=("lost",), location=peers.stage_location))  # fmt: skip
    await peers.inbox.until(lambda: "lost" in peers.lost("decode-t"), "the lost request's RequestLost")
    assert "prefill-t" in peers.lost("decode-t")["lost"].reason
    assert "lost" not in peers.finished("decode-t")  # not failed: its gateway re-prefills it
    await peers.inbox.until(lambda: len(peers.outputs()["ok"]) > 5, "tokens of the running request")
    await peers.bus.publish(topics.EVENTS, Cancel(request_id="ok"))
    await peers.inbox.until(
        lambda: (s := peers.statuses("decode-t")[-1]).idle and s.free_blocks == s.total_blocks, "blocks freed"
    )
    assert "ok" not in peers.finished("decode-t")  # cancelled, not finished
    await stop_worker(worker)


async def test_the_requests_of_a_restarted_gateway_are_cancelled_everywhere(peers: Peers, bus_url: str, tiny: LoadedModel) -> None:  # fmt: skip
    worker = await start_worker(peers, bus_url, tiny)
    spec = SamplingSpec(max_tokens=1000, temperature=0.0, ignore_eos=True)
    planned = await peers.prefill("orphan", prompts([8], 4)[0], spec, staged=False)

    def gateway_beat(state: WorkerState, started_at: float) -> WorkerHeartbeat:
        return WorkerHeartbeat(kind=ServiceKind.GATEWAY, worker_id=peers.gateway, state=state, seq=1,
                               started_at=started_at)  # fmt: skip

    await peers.bus.publish(topics.EVENTS, gateway_beat(WorkerState.READY, started_at=1.0))
    await publish_plan(peers, 31, [planned])
    await peers.inbox.until(lambda: len(peers.outputs()["orphan"]) > 3, "tokens of the running request")
    # the gateway's process died; its successor under the same id beats: nobody reads the old tokens
    await peers.bus.publish(topics.EVENTS, gateway_beat(WorkerState.STARTING, started_at=2.0))
    await peers.inbox.until(
        lambda: any(c.request_id == "orphan" for c in peers.inbox.of(Cancel)), "its Cancel"
    )
    [cancel] = [c for c in peers.inbox.of(Cancel) if c.request_id == "orphan"]
    assert cancel.reason == f"gateway {peers.gateway} restarted"
    await peers.inbox.until(
        lambda: (s := peers.statuses("decode-t")[-1]).idle and s.free_blocks == s.total_blocks, "blocks freed"
    )
    assert "orphan" not in peers.finished("decode-t")
    assert "alignedserve:decode_orphaned_requests_total 1.0" in await metrics_text(peers)
    await stop_worker(worker)


async def test_kv_the_pool_no_longer_has_is_reported_lost_and_the_rest_of_the_batch_decodes(peers: Peers, bus_url: str, tiny: LoadedModel) -> None:  # fmt: skip
    batch = prompts([7, 9], seed=5)
    want = reference(tiny, batch[:1], max_tokens=6, ignore_eos=True)
    worker = await start_worker(peers, bus_url, tiny)
    spec = SamplingSpec(max_tokens=6, temperature=0.0, ignore_eos=True)
    kept = await peers.prefill("kept", batch[0], spec, staged=False)
    gone = await peers.prefill("gone", batch[1], spec, staged=False)
    assert peers.pool.registry.drop("gone")  # the pool lost it (e.g. restarted) after it was planned
    await publish_plan(peers, 41, [kept, gone])  # prefetch off: decode pulls both from the pool
    await peers.inbox.until(lambda: "gone" in peers.lost("decode-t"), "the missing KV's RequestLost")
    assert "KV pull failed" in peers.lost("decode-t")["gone"].reason
    await peers.inbox.until(lambda: "kept" in peers.finished("decode-t"), "the other request to finish")
    assert peers.outputs()["kept"] == want[0] and "gone" not in peers.finished("decode-t")
    await peers.inbox.until(
        lambda: (s := peers.statuses("decode-t")[-1]).idle and s.free_blocks == s.total_blocks, "blocks freed"
    )
    await stop_worker(worker)


async def test_sigterm_hands_running_and_waiting_requests_back_to_the_pool(peers: Peers, bus_url: str, tiny: LoadedModel) -> None:  # fmt: skip
    worker = await start_worker(peers, bus_url, tiny, max_num_seqs=1, drain_timeout_s=1.0)
    spec = SamplingSpec(max_tokens=1000, temperature=0.0, ignore_eos=True)
    planned = [await peers.prefill(rid, p, spec, staged=False) for rid, p in zip(["long", "next"], prompts([8, 6], 4), strict=True)]  # fmt: skip
    await publish_plan(peers, 31, planned)
    await peers.inbox.until(lambda: len(peers.outputs()["long"]) > 3, "tokens of the running request")
    await stop_worker(worker)
    back = {e.request_id: e for e in peers.inbox.of(RequestEvicted)}
    await peers.inbox.until(lambda: len(peers.inbox.of(RequestEvicted)) == 2, "both requests handed back")
    back = {e.request_id: e for e in peers.inbox.of(RequestEvicted)}
    assert {rid: e.to for rid, e in back.items()} == {"long": None, "next": None}
    assert all(e.location == peers.pool_location for e in back.values())
    generated = len(peers.outputs()["long"])
    assert back["long"].state.output_len == generated and back["long"].prefix_len == 8 + generated - 1
    assert "long" in peers.pool_store and "next" in peers.pool_store  # its KV waits there for another worker


def test_a_bad_configuration_names_the_flags_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--num-kv-blocks", "64", "--kv-cache-bytes", "1GiB"]) == 2
    assert "--kv-cache-bytes or --num-kv-blocks" in capsys.readouterr().err
    assert main(["--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs" in capsys.readouterr().err
