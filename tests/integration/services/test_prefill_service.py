"""`alignedserve prefill` and `alignedserve kvpool` as real processes on a tiny random-weight Llama saved
to a temporary directory (weights, config and a word-level tokenizer, so the real loader takes it).

Checks the prefill worker's contract (docs/request-life.md): the first token goes to the gateway as a
TokenBatch, the KV goes to the pool and KvReady to the batcher; that KV, imported into an engine here,
decodes exactly like one engine's `generate` (the disaggregation correctness check); a request ending at
its first token, a prompt longer than the context, batch staging into the candidate buffer, and
backpressure from a full pool. Control bus: Redis database 13 (flushed first)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import redis_databases
import torch
from service_procs import (
    Inbox,
    ServiceProcess,
    bus_at,
    db_url,
    eventually,
    fast_reads,
    flush_db,
    free_port,
    listening,
    stop_cleanly,
)
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from alignedserve.bus import Bus, topics
from alignedserve.bus.messages import (
    BatchPlan,
    Cancel,
    CandidateBuffer,
    FinishReason,
    KvLocation,
    KvReady,
    PlannedRequest,
    PrefetchDone,
    PrefillRequest,
    RequestFinished,
    SamplingSpec,
    ServiceKind,
    TokenBatch,
)
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_envelope import KvEnvelope
from alignedserve.transfer import PeerAddress, PulledKV, TransferEndpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")  # one UCX context for the module: resets cost seconds
DB = redis_databases.PREFILL_SERVICE
BLOCK = 4
CONTEXT = 256
POOL_BYTES = 64 << 10  # a 20-token prompt's KV is 20 x 512 bytes on the tiny model
STAGING_BYTES = 24 << 10  # the staged batch below (17 + 30 tokens) fits, a 30 KiB entry does not
STAGED = "alignedserve:prefill_staged_bytes"
GATEWAY = "gw-prefill-test"
DECODE = "decode-t"
PREFILL_ID = "prefill-t"
TINY_LLAMA = LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=CONTEXT, eos_token_id=2, bos_token_id=1,
)  # fmt: skip


def save_tiny_model(directory: Path) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY_LLAMA).eval()
    model.generation_config.eos_token_id = 2
    model.save_pretrained(directory)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_LLAMA.vocab_size)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")  # fmt: skip
    wrapped.save_pretrained(directory)
    return directory


@dataclass
class Stack:
    pool: ServiceProcess
    prefill: ServiceProcess
    pool_address: PeerAddress
    bus_url: str
    model_dir: Path
    engine: LLMEngine  # the same weights, in this process: the reference and the importer


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    url = db_url(redis_url, DB)
    flush_db(url)
    root = tmp_path_factory.mktemp("prefill")
    model_dir = save_tiny_model(root / "tiny-llama")
    pool_port = free_port()
    pool = ServiceProcess("kvpool", ["--bus", fast_reads(url), "--pool-bytes", str(POOL_BYTES), "--transfer-port",
                                     str(pool_port), "--worker-id", "kvpool-p"], root / "kvpool.log", free_port())  # fmt: skip
    prefill_args = [
        "--bus", fast_reads(url), "--model", str(model_dir), "--worker-id", PREFILL_ID, "--block-size", str(BLOCK),
        "--num-kv-blocks", "256", "--max-prefill-tokens", "256", "--num-threads", "1", "--dtype", "float32",
        "--pool-retry-s", "0.05", "--staging-bytes", str(STAGING_BYTES),
    ]  # fmt: skip
    prefill = ServiceProcess("prefill", prefill_args, root / "prefill.log", free_port())
    try:
        pool.wait_ready()
        prefill.wait_ready()
        engine = LLMEngine(
            EngineConfig(model=str(model_dir), block_size=BLOCK, num_blocks=256, num_threads=1)
        )
        yield Stack(pool, prefill, PeerAddress("127.0.0.1", pool_port), url, model_dir, engine)
    finally:
        stop_cleanly(prefill, pool)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def bus(stack: Stack) -> AsyncIterator[Bus]:
    async with bus_at(stack.bus_url) as connected:
        yield connected


@pytest_asyncio.fixture(loop_scope="module")
async def inbox(bus: Bus) -> AsyncIterator[Inbox]:
    watched = (topics.tokens(GATEWAY), topics.BATCHER, topics.decode(DECODE))
    async with listening(bus, *watched) as listened:
        yield listened


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def endpoint() -> AsyncIterator[TransferEndpoint]:
    async with TransferEndpoint() as ep:
        yield ep


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, TINY_LLAMA.vocab_size, length).tolist()  # type: ignore[no-any-return]


def request(prompt: list[int], max_tokens: int = 8, rid: str = "") -> PrefillRequest:
    sampling = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return PrefillRequest(request_id=rid or f"r-{os.urandom(4).hex()}", model="tiny-llama",
                          prompt_token_ids=tuple(prompt), sampling=sampling, arrival=time.time(), gateway_id=GATEWAY)  # fmt: skip


def for_request(rid: str):  # type: ignore[no-untyped-def]
    return lambda message: getattr(message, "request_id", None) == rid


def first_entry_of(rid: str):  # type: ignore[no-untyped-def]
    return lambda batch: any(e.request_id == rid for e in batch.entries)


async def pull_from(
    endpoint: TransferEndpoint, location: KvLocation, rid: str
) -> tuple[KvEnvelope, PulledKV]:
    pulled = await endpoint.pull(
        PeerAddress.from_wire(location.ucx_address_key), rid, lambda _h, n: bytearray(n)
    )
    return KvEnvelope.from_bytes(pulled.header), pulled


def decode_imported(engine: LLMEngine, rid: str, envelope: KvEnvelope, payload: bytearray, max_tokens: int) -> list[int]:  # fmt: skip
    """Continue the request from its imported KV in this process's engine, greedily, to the end."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.import_request(rid, envelope.export(payload), list(envelope.prompt_token_ids),
                          list(envelope.output_token_ids), params)  # fmt: skip
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.output_token_ids


def reference(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt], params)[0].output_token_ids


async def test_prefill_hands_off_and_the_pooled_kv_decodes_like_one_engine(stack: Stack, bus: Bus, inbox: Inbox, endpoint: TransferEndpoint) -> None:  # fmt: skip
    prompt = prompt_of(21, seed=1)
    sent = request(prompt, max_tokens=8)
    await bus.publish(topics.PREFILL, sent)
    await bus.publish(topics.PREFILL, dataclasses.replace(sent, message_id="re-published"))
    tokens = await inbox.take(TokenBatch, first_entry_of(sent.request_id))
    entry = next(e for e in tokens.entries if e.request_id == sent.request_id)
    assert entry.first_index == 0 and len(entry.token_ids) == 1 and entry.finish_reason is None
    assert tokens.worker_id == PREFILL_ID
    ready = await inbox.take(KvReady, for_request(sent.request_id))
    assert ready.prefix_len == 21 and ready.blocks == 6  # ceil(21 / 4)
    assert ready.location.kind is ServiceKind.KVPOOL and ready.location.worker_id == "kvpool-p"
    assert PeerAddress.from_wire(ready.location.ucx_address_key) == stack.pool_address
    assert ready.state.gateway_id == GATEWAY and ready.state.output_len == 1
    assert ready.state.recent_token_ids == entry.token_ids
    await eventually(lambda: stack.pool.metric("alignedserve:kv_pool_entries") == 1, "the KV in the pool")

    envelope, pulled = await pull_from(endpoint, ready.location, sent.request_id)
    assert envelope.prompt_token_ids == tuple(prompt) and envelope.output_token_ids == entry.token_ids
    assert envelope.kv.num_tokens == 21
    want = reference(stack.engine, prompt, max_tokens=8)
    assert list(entry.token_ids) == want[:1]
    assert decode_imported(stack.engine, sent.request_id, envelope, pulled.buffer, 8) == want
    await eventually(
        lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "the pool to release it"
    )


async def test_a_request_ending_at_its_first_token_finishes_at_prefill_and_a_too_long_prompt_fails_alone(stack: Stack, bus: Bus, inbox: Inbox) -> None:  # fmt: skip
    one = request(prompt_of(9, seed=2), max_tokens=1)
    too_long = request(prompt_of(CONTEXT + 10, seed=3))
    normal = request(prompt_of(12, seed=4))
    for sent in (one, too_long, normal):
        await bus.publish(topics.PREFILL, sent)
    finished = await inbox.take(RequestFinished, for_request(one.request_id))
    assert finished.finish_reason is FinishReason.LENGTH
    assert (finished.prompt_tokens, finished.completion_tokens) == (9, 1)
    batch = await inbox.take(TokenBatch, first_entry_of(one.request_id))
    assert (
        next(e for e in batch.entries if e.request_id == one.request_id).finish_reason is FinishReason.LENGTH
    )
    failed = await inbox.take(RequestFinished, for_request(too_long.request_id))
    assert failed.finish_reason is FinishReason.ERROR
    assert f"prompt has {CONTEXT + 10} tokens" in failed.error and "context" in failed.error
    await inbox.take(KvReady, for_request(normal.request_id))  # the worker keeps serving
    assert not [m for m in inbox.messages if isinstance(m, KvReady) and m.request_id in (one.request_id, too_long.request_id)]  # fmt: skip
    await bus.publish(topics.EVENTS, Cancel(request_id=normal.request_id))
    await eventually(
        lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "the cancelled KV released"
    )


async def test_a_staged_batch_is_pulled_into_the_candidate_buffer_and_served_from_there(stack: Stack, bus: Bus, inbox: Inbox, endpoint: TransferEndpoint) -> None:  # fmt: skip
    prompts = [prompt_of(17, seed=5), prompt_of(30, seed=6)]
    sent = [request(p, max_tokens=6) for p in prompts]
    for r in sent:
        await bus.publish(topics.PREFILL, r)
    readies = [await inbox.take(KvReady, for_request(r.request_id)) for r in sent]
    planned = tuple(
        PlannedRequest(request_id=k.request_id, prefix_len=k.prefix_len, blocks=k.blocks, location=k.location,
                       state=k.state, arrival=k.arrival)
        for k in readies
    )  # fmt: skip
    plan = BatchPlan(batch_id=1, decode_worker_id=DECODE, staging_worker_id=PREFILL_ID,
                     buffer=CandidateBuffer.BATCH, requests=planned)  # fmt: skip
    await bus.publish(topics.staging(PREFILL_ID), plan)
    done = await inbox.take(PrefetchDone)
    assert done.batch_id == 1 and done.decode_worker_id == DECODE and done.buffer is CandidateBuffer.BATCH
    assert set(done.ready) == {r.request_id for r in sent} and done.failed == ()
    assert done.location is not None and done.location.kind is ServiceKind.PREFILL
    assert done.location.worker_id == PREFILL_ID
    await eventually(
        lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "the pool entries pulled"
    )
    for r, p in zip(sent, prompts, strict=True):
        envelope, pulled = await pull_from(endpoint, done.location, r.request_id)
        assert decode_imported(stack.engine, r.request_id, envelope, pulled.buffer, 6) == reference(
            stack.engine, p, 6
        )
    assert stack.prefill.metric("alignedserve:prefill_staged_requests_total") >= 2
    await eventually(lambda: stack.prefill.metric(STAGED) == 0, "the staged KV released once pulled")


async def test_kv_beyond_the_staging_budget_is_listed_as_failed_and_stays_in_the_pool(stack: Stack, bus: Bus, inbox: Inbox, endpoint: TransferEndpoint) -> None:  # fmt: skip
    sent = request(prompt_of(10, seed=8))
    await bus.publish(topics.PREFILL, sent)
    small = await inbox.take(KvReady, for_request(sent.request_id))
    big_id, big = (
        f"big-{os.urandom(3).hex()}",
        np.random.default_rng(9).integers(0, 256, 30 << 10, dtype=np.uint8),
    )
    await endpoint.push(stack.pool_address, big_id, b"h", big)
    big_planned = PlannedRequest(request_id=big_id, prefix_len=60, blocks=15, location=small.location,
                                 state=small.state, arrival=small.arrival)  # fmt: skip
    small_planned = PlannedRequest(request_id=small.request_id, prefix_len=small.prefix_len, blocks=small.blocks,
                                   location=small.location, state=small.state, arrival=small.arrival)  # fmt: skip
    plan = BatchPlan(batch_id=2, decode_worker_id=DECODE, staging_worker_id=PREFILL_ID,
                     buffer=CandidateBuffer.REQUESTS, requests=(big_planned, small_planned))  # fmt: skip
    await bus.publish(topics.staging(PREFILL_ID), plan)
    done = await inbox.take(PrefetchDone, lambda d: d.batch_id == 2)
    assert done.ready == (small.request_id,) and done.failed == (big_id,)
    into = np.zeros_like(big)  # the refused pull left the pool's entry intact and servable
    await endpoint.pull(stack.pool_address, big_id, into)
    assert np.array_equal(into, big)
    assert done.location is not None
    assert stack.prefill.metric(STAGED) > 0
    await bus.publish(
        topics.EVENTS, Cancel(request_id=small.request_id)
    )  # drops it from the candidate buffer
    await eventually(lambda: stack.prefill.metric(STAGED) == 0, "the cancelled request to leave the buffer")
    await eventually(lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "an empty pool")


async def test_a_full_pool_makes_prefill_back_off_until_room_frees(stack: Stack, bus: Bus, inbox: Inbox, endpoint: TransferEndpoint) -> None:  # fmt: skip
    await eventually(lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "an empty pool")
    filler_id, filler = f"filler-{os.urandom(3).hex()}", np.ones(POOL_BYTES - 4096, np.uint8)
    await endpoint.push(stack.pool_address, filler_id, b"", filler)
    waits = stack.prefill.metric("alignedserve:prefill_pool_full_waits_total")
    sent = request(prompt_of(20, seed=7))  # 10 KiB of KV: does not fit the 4 KiB left
    await bus.publish(topics.PREFILL, sent)
    await inbox.take(TokenBatch, first_entry_of(sent.request_id))
    await eventually(lambda: stack.prefill.metric("alignedserve:prefill_pool_full_waits_total") > waits + 1, "back-offs")  # fmt: skip
    assert not [m for m in inbox.messages if isinstance(m, KvReady)]
    await endpoint.pull(stack.pool_address, filler_id, np.zeros_like(filler))  # room frees
    ready = await inbox.take(KvReady, for_request(sent.request_id))
    assert ready.prefix_len == 20
    envelope, _ = await pull_from(endpoint, ready.location, sent.request_id)
    assert envelope.prompt_token_ids == sent.prompt_token_ids
    await eventually(lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "an empty pool")


async def test_the_next_forward_runs_while_a_hand_off_waits_and_the_one_after_waits_for_it(stack: Stack, bus: Bus, inbox: Inbox, endpoint: TransferEndpoint) -> None:  # fmt: skip
    """A forward's KV hand-offs run while the next forward computes, not before it; the forward after
    that waits for them, so a full pool holds back at most one forward's KV."""
    await eventually(lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "an empty pool")
    filler_id, filler = f"filler-{os.urandom(3).hex()}", np.ones(POOL_BYTES - 4096, np.uint8)
    await endpoint.push(stack.pool_address, filler_id, b"", filler)
    waiting, next_one, held_back = (request(prompt_of(20, seed=30 + i)) for i in range(3))  # 10 KiB each
    await bus.publish(topics.PREFILL, waiting)
    await inbox.take(TokenBatch, first_entry_of(waiting.request_id))  # its hand-off now backs off
    await bus.publish(topics.PREFILL, next_one)
    await inbox.take(TokenBatch, first_entry_of(next_one.request_id))  # its forward ran meanwhile
    await bus.publish(topics.PREFILL, held_back)
    await asyncio.sleep(1.0)
    assert not [
        b for b in inbox.messages if isinstance(b, TokenBatch) and first_entry_of(held_back.request_id)(b)
    ]
    assert not [m for m in inbox.messages if isinstance(m, KvReady)]
    await endpoint.pull(stack.pool_address, filler_id, np.zeros_like(filler))  # room frees
    for sent in (waiting, next_one, held_back):
        ready = await inbox.take(KvReady, for_request(sent.request_id))
        envelope, _ = await pull_from(endpoint, ready.location, sent.request_id)
        assert envelope.prompt_token_ids == sent.prompt_token_ids
    await eventually(lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "an empty pool")


async def test_sigterm_loses_no_acknowledged_prompt(stack: Stack, bus: Bus, inbox: Inbox) -> None:
    """Last in the module: it stops the prefill worker, with the pool full (each of these prompts' KV
    is 50 KiB of the 64 KiB pool). Every prompt ends one of three ways: handed off (KvReady), failed
    with a clear error (its hand-off could not wait for room any more), or back in the group's backlog
    for another prefill worker. None is lost."""
    sent = [request(prompt_of(100, seed=10 + i), max_tokens=4) for i in range(8)]
    await bus.publish_many(topics.PREFILL, sent)
    await inbox.take(KvReady, for_request(sent[0].request_id))
    stack.prefill.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(stack.prefill.process.wait, 60) == 0, stack.prefill.logs()
    await asyncio.sleep(1.0)  # the last messages may still be on their way to this test's reader
    ours = {r.request_id for r in sent}
    handed_off = {m.request_id for m in inbox.messages if isinstance(m, KvReady) and m.request_id in ours}
    handed_off.add(sent[0].request_id)
    failed = [m for m in inbox.messages if isinstance(m, RequestFinished) and m.request_id in ours]
    assert all(m.finish_reason is FinishReason.ERROR and "draining" in m.error for m in failed)
    left = await bus.backlog(topics.PREFILL, topics.PREFILL_GROUP)
    assert len(handed_off) + len(failed) + left == len(sent), (handed_off, failed, left)
    assert left > 0, "the prompts not started were not handed back"
    for rid in handed_off:
        await bus.publish(topics.EVENTS, Cancel(request_id=rid))
    await eventually(lambda: stack.pool.metric("alignedserve:kv_pool_used_bytes") == 0, "an empty pool")
