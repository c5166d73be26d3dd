"""The stack as real processes: one with Redis Streams (2 decode workers), one with Kafka (tansu)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import redis_databases
from e2e_stack import Stack, start_stack

E2E_REDIS_DB = redis_databases.E2E_STACK


def _dedicated_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, ""))


# module scope: the stacks (5 model-holding processes) stop before other test folders run, so their
# memory is freed and their heartbeats never reach tests sharing the session's Kafka broker
@pytest.fixture(scope="module")
def redis_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    url = _dedicated_db(redis_url, E2E_REDIS_DB)
    redis.Redis.from_url(url).flushdb()
    stack = start_stack(url, Path(tmp_path_factory.mktemp("stack-redis")), prefill=1, decode=2)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def kafka_stack(kafka_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(kafka_url, Path(tmp_path_factory.mktemp("stack-kafka")), prefill=1, decode=1)
    yield stack
    stack.stop()


@pytest.fixture(params=["redis", "kafka"])
def stack(request: pytest.FixtureRequest) -> Stack:
    """Each bus, through HTTP."""
    return request.getfixturevalue(f"{request.param}_stack")  # type: ignore[no-any-return]
