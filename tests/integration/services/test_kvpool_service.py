"""`alignedserve kvpool` as a real process: KV pushed over UCX from this test comes back bit-exactly and
is released; a push beyond the byte budget is refused (backpressure) until room frees; a Cancel on the
events topic releases an entry, and so does its lease running out (nobody pulled it). Control bus: Redis database 12 (flushed first)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import pytest_asyncio
import redis_databases
from service_procs import ServiceProcess, bus_at, db_url, eventually, fast_reads, flush_db, free_port

from alignedserve.bus import topics
from alignedserve.bus.messages import Cancel
from alignedserve.transfer import KeyNotFound, PeerAddress, PushRejected, TransferEndpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")  # one UCX context for the module: resets cost seconds
DB = redis_databases.KVPOOL_SERVICE
BUDGET = 64 << 10
LEASE_TTL_S = 5.0  # above any other test's wait between a push and its pull
USED = "alignedserve:kv_pool_used_bytes"


class Pool:
    def __init__(self, process: ServiceProcess, address: PeerAddress, bus_url: str) -> None:
        self.process = process
        self.address = address
        self.bus_url = bus_url

    def used(self) -> float:
        return self.process.metric(USED)


@pytest.fixture(scope="module")
def pool(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    url = db_url(redis_url, DB)
    flush_db(url)
    transfer_port = free_port()
    args = ["--bus", fast_reads(url), "--pool-bytes", str(BUDGET), "--transfer-port", str(transfer_port),
            "--worker-id", "kvpool-t", "--log-format", "json", "--lease-ttl-s", str(LEASE_TTL_S)]  # fmt: skip
    log_path = tmp_path_factory.mktemp("kvpool") / "kvpool.log"
    process = ServiceProcess("kvpool", args, log_path, free_port())
    try:
        process.wait_ready()
        yield Pool(process, PeerAddress("127.0.0.1", transfer_port), url)
    finally:
        assert process.stop() == 0, process.logs()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def endpoint() -> AsyncIterator[TransferEndpoint]:
    async with TransferEndpoint() as ep:
        yield ep


def payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def key() -> str:
    return f"req-{os.urandom(4).hex()}"


async def test_pushed_kv_is_pulled_back_bit_exactly_then_released(pool: Pool, endpoint: TransferEndpoint) -> None:  # fmt: skip
    rid, data = key(), payload(20_000, seed=1)
    await endpoint.push(pool.address, rid, b"header-bytes", data)
    await eventually(lambda: pool.used() == data.nbytes, "the pool to count the entry")
    assert pool.process.metric("alignedserve:kv_pool_entries") == 1
    into = np.zeros(data.nbytes, np.uint8)
    pulled = await endpoint.pull(pool.address, rid, into)
    assert pulled.header == b"header-bytes" and np.array_equal(into, data)
    await eventually(lambda: pool.used() == 0, "the pool to release a pulled entry")
    with pytest.raises(KeyNotFound):
        await endpoint.pull(pool.address, rid, np.zeros(data.nbytes, np.uint8))


async def test_a_push_beyond_the_budget_is_refused_and_succeeds_after_a_release(pool: Pool, endpoint: TransferEndpoint) -> None:  # fmt: skip
    first, second = key(), key()
    refusals = pool.process.metric("alignedserve:kv_pool_refusals")
    await endpoint.push(pool.address, first, b"", payload(40 << 10, seed=2))
    big = payload(30 << 10, seed=3)
    with pytest.raises(PushRejected, match="pool full"):
        await endpoint.push(pool.address, second, b"", big)
    assert pool.process.metric("alignedserve:kv_pool_refusals") == refusals + 1
    await endpoint.pull(pool.address, first, np.zeros(40 << 10, np.uint8))  # frees room
    await eventually(lambda: pool.used() == 0, "the release")
    await endpoint.push(pool.address, second, b"", big)
    into = np.zeros(big.nbytes, np.uint8)
    await endpoint.pull(pool.address, second, into)
    assert np.array_equal(into, big)
    await eventually(lambda: pool.used() == 0, "the release")


async def test_cancel_on_the_events_topic_releases_the_entry(pool: Pool, endpoint: TransferEndpoint) -> None:
    rid = key()
    await endpoint.push(pool.address, rid, b"", payload(10_000, seed=4))
    await eventually(lambda: pool.used() == 10_000, "the entry")
    async with bus_at(pool.bus_url) as bus:
        await bus.publish(topics.EVENTS, Cancel(request_id=rid))
    await eventually(lambda: pool.used() == 0, "the cancelled entry to be released")
    with pytest.raises(KeyNotFound):
        await endpoint.pull(pool.address, rid, np.zeros(10_000, np.uint8))


async def test_an_entry_nobody_pulls_within_its_lease_is_freed(
    pool: Pool, endpoint: TransferEndpoint
) -> None:
    rid, expired = key(), "alignedserve:kv_pool_lease_expired_total"
    before = pool.process.metric(expired)
    await endpoint.push(pool.address, rid, b"", payload(10_000, seed=5))
    await eventually(lambda: pool.used() == 10_000, "the entry")
    await eventually(lambda: pool.used() == 0, "the lease to run out", timeout_s=3 * LEASE_TTL_S)
    assert pool.process.metric(expired) == before + 1
    assert any(
        '"kv_lease_expired"' in line and rid in line for line in pool.process.logs(100_000).splitlines()
    )
    with pytest.raises(KeyNotFound):
        await endpoint.pull(pool.address, rid, np.zeros(10_000, np.uint8))
