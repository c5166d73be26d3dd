"""A batcher killed and started again loses no request: kvpool, prefill, batcher and decode as real
processes on a tiny random-weight Llama, the test playing the gateway over Redis (database 10, flushed).

Requests are prefilled while the batcher has no decode worker to plan for: their KV waits in the pool, the
batcher holds them in its in-memory index and has acknowledged their KvReady. It is SIGKILLed; more
requests are prefilled while no batcher runs. Then a decode worker and a new batcher start: the kvpool
re-announces what it holds, and every request decodes to its full length, greedily equal to one engine.
The kvpool's heartbeats carry its KV bytes and budget on the way."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import redis_databases
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
from test_prefill_service import save_tiny_model

from alignedserve.bus import Bus, topics
from alignedserve.bus.messages import (
    FinishReason,
    PrefillRequest,
    RequestFinished,
    SamplingSpec,
    ServiceKind,
    TokenBatch,
    WorkerHeartbeat,
)
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")
DB = redis_databases.BATCHER_RESTART
BLOCK = 4
POOL_BYTES = 1 << 20
MAX_TOKENS = 6
GATEWAY = "gw-restart"
POOL_ID = "kvpool-r"
BATCHER_ID = "batcher-r"
ENGINE = ["--block-size", str(BLOCK), "--num-kv-blocks", "256", "--num-threads", "1", "--dtype", "float32"]


@dataclass
class Cluster:
    root: Path
    bus_url: str
    model_dir: Path
    pool: ServiceProcess
    prefill: ServiceProcess

    def batcher(self, name: str) -> ServiceProcess:
        args = ["--bus", fast_reads(self.bus_url), "--worker-id", BATCHER_ID, "--block-size", str(BLOCK),
                "--min-batch", "1", "--max-batch", "16"]  # fmt: skip
        return ServiceProcess("batcher", args, self.root / f"{name}.log", free_port())

    def decode(self) -> ServiceProcess:
        args = ["--bus", fast_reads(self.bus_url), "--model", str(self.model_dir), "--worker-id", "decode-r",
                "--max-num-seqs", "16", *ENGINE]  # fmt: skip
        return ServiceProcess("decode", args, self.root / "decode.log", free_port())


@pytest.fixture(scope="module")
def cluster(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    url = db_url(redis_url, DB)
    flush_db(url)
    root = tmp_path_factory.mktemp("batcher-restart")
    model_dir = save_tiny_model(root / "tiny-llama")
    pool = ServiceProcess("kvpool", ["--bus", fast_reads(url), "--pool-bytes", str(POOL_BYTES),
                                     "--worker-id", POOL_ID], root / "kvpool.log", free_port())  # fmt: skip
    prefill_args = ["--bus", fast_reads(url), "--model", str(model_dir), "--worker-id", "prefill-r",
                    "--max-prefill-tokens", "256", *ENGINE]  # fmt: skip
    prefill = ServiceProcess("prefill", prefill_args, root / "prefill.log", free_port())
    try:
        pool.wait_ready()
        prefill.wait_ready()
        yield Cluster(root, url, model_dir, pool, prefill)
    finally:
        stop_cleanly(prefill, pool)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def bus(cluster: Cluster) -> AsyncIterator[Bus]:
    async with bus_at(cluster.bus_url) as connected:
        yield connected


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, length).tolist()  # type: ignore[no-any-return]


def request(prompt: list[int]) -> PrefillRequest:
    sampling = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return PrefillRequest(request_id=f"r-{os.urandom(4).hex()}", model="tiny-llama", prompt_token_ids=tuple(prompt),
                          sampling=sampling, arrival=time.time(), gateway_id=GATEWAY)  # fmt: skip


def outputs(tokens: Inbox) -> dict[str, dict[int, int]]:
    """request id -> output position -> token, from every TokenBatch (a position must never differ)."""
    seen: dict[str, dict[int, int]] = {}
    for batch in (m for m in tokens.messages if isinstance(m, TokenBatch)):
        for entry in batch.entries:
            positions = seen.setdefault(entry.request_id, {})
            for offset, token in enumerate(entry.token_ids):
                assert positions.setdefault(entry.first_index + offset, token) == token, entry
    return seen


def finished(tokens: Inbox) -> dict[str, RequestFinished]:
    return {m.request_id: m for m in tokens.messages if isinstance(m, RequestFinished)}


async def test_requests_waiting_in_the_pool_complete_after_the_batcher_is_killed_and_restarted(
    cluster: Cluster, bus: Bus
) -> None:
    pool = cluster.pool
    first = [request(prompt_of(10 + 7 * i, seed=i)) for i in range(4)]
    during = [request(prompt_of(13 + 5 * i, seed=10 + i)) for i in range(3)]  # while no batcher runs
    started: list[ServiceProcess] = []

    def start(process: ServiceProcess) -> ServiceProcess:
        started.append(process)
        return process

    async with listening(bus, topics.tokens(GATEWAY)) as tokens, listening(bus, topics.EVENTS) as events:
        try:
            old = start(cluster.batcher("batcher-old"))
            old.wait_ready()
            for sent in first:
                await bus.publish(topics.PREFILL, sent)
            # no decode worker yet: the batcher holds them (their KvReady acknowledged), the pool their KV
            await eventually(lambda: old.metric("alignedserve:batcher_waiting_requests") == 4, "4 waiting")
            await eventually(lambda: pool.metric("alignedserve:kv_pool_announced_entries") == 4, "4 indexed")
            old.process.kill()
            old.process.wait()

            for sent in during:
                await bus.publish(topics.PREFILL, sent)
            await eventually(
                lambda: pool.metric("alignedserve:kv_pool_entries") == 7, "7 entries in the pool"
            )
            await eventually(lambda: pool.metric("alignedserve:kv_pool_announced_entries") == 7, "7 indexed")
            used = pool.metric("alignedserve:kv_pool_used_bytes")
            beat = await events.take(
                WorkerHeartbeat, lambda b: b.kind is ServiceKind.KVPOOL and b.kv_used_bytes == used
            )
            assert (beat.worker_id, beat.kv_capacity_bytes) == (POOL_ID, POOL_BYTES) and used > 0

            decode, new = start(cluster.decode()), start(cluster.batcher("batcher-new"))
            decode.wait_ready()
            new.wait_ready()
            everyone = {r.request_id for r in first + during}
            await eventually(lambda: everyone <= finished(tokens).keys(), "every request to finish", 90.0)
            assert pool.metric("alignedserve:kv_pool_reannounced_total") == 7  # to the new batcher only
            await eventually(lambda: pool.metric("alignedserve:kv_pool_used_bytes") == 0, "an empty pool")
            stop_cleanly(new, decode)
        finally:
            for process in started:
                if process.process.poll() is None:
                    process.process.kill()
                    process.process.wait()

    ends, produced = finished(tokens), outputs(tokens)
    engine = LLMEngine(
        EngineConfig(model=str(cluster.model_dir), block_size=BLOCK, num_blocks=256, num_threads=1)
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for sent in first + during:
        rid = sent.request_id
        assert ends[rid].finish_reason is FinishReason.LENGTH, ends[rid]
        assert (ends[rid].prompt_tokens, ends[rid].completion_tokens) == (
            len(sent.prompt_token_ids),
            MAX_TOKENS,
        )
        want = engine.generate([list(sent.prompt_token_ids)], params)[0].output_token_ids
        assert [produced[rid][i] for i in sorted(produced[rid])] == want, rid
