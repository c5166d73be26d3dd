"""Faults in the data plane: a KV pool too small for the load, and UCX endpoints dropped mid-transfer.

Each case runs a stack of its own (1 prefill, 2 decode workers, kvpool, batcher, gateway) under its own
deployment name on the chaos suite's Redis database, so neither reads the other's messages nor those of
test_chaos.py's stack. The assertions and the report rows are test_chaos.py's: every request ends, none
is malformed, every completed stream is token for token the undisturbed greedy run, no KV stays held.

- kvpool full: the pool has room for about half the KV of the twelve requests in flight; the prefill
  worker backs off and retries its hand-offs (backpressure), no client gets an error, nothing is lost.
- endpoint dropped: every 3rd transfer of each prefill, kvpool and decode endpoint loses its connection
  after part of the payload (`ALIGNEDSERVE_TRANSFER_FAULTS`); the other side retries on a new connection
  or its request is re-prefilled, and no request decodes on partial KV.

The reference texts come from the pool-full stack before its load, when the pool still holds the four
reference requests at once: an undisturbed run. `make test` runs the pool-full case (one stack); the
dropped-endpoint case, a second stack, runs under CHAOS_ALL=1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import redis_databases
from chaos_load import COMPLETED, Row, references
from chaos_stack import MAX_INFLIGHT, STACK_ENV, ChaosStack, start_stack
from test_chaos import MAX_TOKENS, chaos_case, check, full_suite_only, no_fault

from alignedserve.transfer.faults import FAULTS_ENV

pytestmark = pytest.mark.slow

# SmolLM2-135M's KV is 46 kB per token (float32): a load prompt's (6-12 tokens) is 0.28-0.55 MB, so
# 2.5 MB holds the four reference requests at once but not the twelve the load keeps in flight
POOL_BYTES = "2500000"
FULL_POOL_REQUESTS = 2 * MAX_INFLIGHT
DROP_AFTER_BYTES = 64 << 10  # part of every payload (each is hundreds of kB)
DROP_EVERY = 3  # a retry lands on another transfer number: it goes through


def stack_on_own_deployment(
    redis_url: str, log_dir: Path, deployment: str, env: dict[str, str]
) -> ChaosStack:
    """A stack on the chaos database under `deployment`, its leftovers of an earlier run deleted first."""
    parts = urlsplit(redis_url)
    url = urlunsplit((parts.scheme, parts.netloc, f"/{redis_databases.CHAOS}", parts.query, ""))
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{deployment}.*"):
        client.delete(key)
    return start_stack(url, log_dir, decode=2, env={**STACK_ENV, **env}, deployment=deployment)


def pool_pressure(stack: ChaosStack) -> tuple[float, float]:
    """Pushes the pool refused, hand-offs the prefill worker backed off (both since start)."""
    return (stack.metric("kvpool-0", "alignedserve:kv_pool_refusals"),
            stack.metric("prefill-0", "alignedserve:prefill_pool_full_waits_total"))  # fmt: skip


@pytest.fixture(scope="module")
def full_pool_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    env = {"ALIGNEDSERVE_KVPOOL_POOL_BYTES": POOL_BYTES}
    stack = stack_on_own_deployment(redis_url, tmp_path_factory.mktemp("pool-full"), "chaos-pool-full", env)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def reference(full_pool_stack: ChaosStack) -> dict[str, str]:
    refusals = full_pool_stack.metric("kvpool-0", "alignedserve:kv_pool_refusals")
    texts: dict[str, str] = asyncio.run(references(full_pool_stack.url, MAX_TOKENS))
    assert full_pool_stack.metric("kvpool-0", "alignedserve:kv_pool_refusals") == refusals, (
        "the reference run met a full pool: it is not undisturbed"
    )
    return texts


@pytest.fixture
def dropping_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    """Its case's own stack, stopped at the end of it (skipped before it starts outside `make chaos`)."""
    full_suite_only()
    env = {FAULTS_ENV: f"drop_after_bytes={DROP_AFTER_BYTES},every={DROP_EVERY}"}
    stack = stack_on_own_deployment(redis_url, tmp_path_factory.mktemp("dropped"), "chaos-drops", env)
    yield stack
    stack.stop()


def test_kv_pool_full_under_load_backs_off_and_loses_nothing(
    full_pool_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    stack = full_pool_stack
    before = pool_pressure(stack)
    result = asyncio.run(chaos_case(stack, f"kvpool full ({int(POOL_BYTES) / 1e6:.1f} MB, {MAX_INFLIGHT} in flight)",
                                    no_fault, requests=FULL_POOL_REQUESTS, concurrency=MAX_INFLIGHT))  # fmt: skip
    after = pool_pressure(stack)
    refused, waited = after[0] - before[0], after[1] - before[1]
    result[0].note = f"{refused:.0f} pushes refused, {waited:.0f} hand-off back-offs"
    case = check(result, reference, chaos_rows)
    assert all(o.end == COMPLETED for o in result[1]), [(o.end, o.status, o.detail) for o in result[1]]
    assert refused > 0 and waited > 0, "the pool never filled up"
    assert case.completed == case.sent
    assert stack.metric("kvpool-0", "alignedserve:kv_pool_lease_expired_total") == 0


def test_ucx_endpoints_dropped_mid_transfer_retry_or_reprefill(
    dropping_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    stack = dropping_stack
    fault = f"UCX endpoint dropped after {DROP_AFTER_BYTES >> 10} kB, every {DROP_EVERY}rd transfer"
    result = asyncio.run(chaos_case(stack, fault, no_fault))
    retried = sum(stack.metric(s, "alignedserve:kv_transfer_retries_total") for s in stack.services)
    migrated = stack.metric("gateway", "alignedserve:request_migrations_total")
    result[0].note = f"{retried:.0f} transfer retries, {migrated:.0f} requests re-prefilled"
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent
    assert retried > 0, "no transfer was dropped: the fault missed the load"
