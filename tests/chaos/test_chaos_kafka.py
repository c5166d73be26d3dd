"""The kills of test_chaos.py on the Kafka bus: a private tansu broker, 1 prefill and 2 decode workers.

What changes under Kafka is how work moves after a death: a killed consumer's partitions go to the
group's other members (or to its restarted self) after the group's session timeout, where Redis
reclaims idle pending entries. Clients must see the same: every request completes, each token once.
The assertions are test_chaos.py's (`check`). It starts a broker and a stack of its own, so the module
runs in `make chaos` (CHAOS_ALL=1) only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos_load import Row, references
from chaos_stack import STACK_ENV, ChaosStack, run_all, start_stack
from test_chaos import (
    MAX_TOKENS,
    RECOVERY_LIMIT_S,
    Inject,
    chaos_case,
    check,
    kill_batcher_mid_load,
    kill_decode_mid_decode,
    kill_kvpool_mid_load,
    kill_prefill_mid_load,
    migrations,
)

from alignedserve.bus.embedded import start_kafka

pytestmark = [
    pytest.mark.slow,
    # a skip mark, not a skip in the test: the module's broker and stack are never started
    pytest.mark.skipif(not run_all(), reason="in `make chaos` only (CHAOS_ALL=1)"),
]


@pytest.fixture(scope="module")
def kafka_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    """Its own tansu (production group settings, as the Redis stack has), so no other test's topics."""
    with start_kafka() as broker:
        stack = start_stack(broker.url, Path(tmp_path_factory.mktemp("chaos-kafka")), decode=2, env=STACK_ENV)
        yield stack
        stack.stop()


@pytest.fixture(scope="module")
def reference(kafka_stack: ChaosStack) -> dict[str, str]:
    return asyncio.run(references(kafka_stack.url, MAX_TOKENS))


# (fault, inject, recovery limit): as in test_chaos.py, a dead kvpool's recovery is reported, not bounded
KILLS: dict[str, tuple[str, Inject, float | None]] = {
    "decode": ("SIGKILL decode (of 2), Kafka", kill_decode_mid_decode, RECOVERY_LIMIT_S),
    "prefill": ("SIGKILL prefill (of 1), Kafka", kill_prefill_mid_load, RECOVERY_LIMIT_S),
    "batcher": ("SIGKILL batcher, Kafka", kill_batcher_mid_load, RECOVERY_LIMIT_S),
    "kvpool": ("SIGKILL kvpool, Kafka", kill_kvpool_mid_load, None),
}


@pytest.mark.parametrize("victim", list(KILLS))
def test_sigkill_mid_load_on_kafka(
    victim: str, kafka_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    fault, inject, recovery_limit_s = KILLS[victim]
    moved = migrations(kafka_stack)
    result = asyncio.run(chaos_case(kafka_stack, fault, inject))
    case = check(result, reference, chaos_rows, recovery_limit_s)
    assert case.completed == case.sent
    assert case.recovery_s is not None, "the stack never served again"
    if victim == "decode":
        assert migrations(kafka_stack) > moved, "the victim held no request: the fault missed the load"
