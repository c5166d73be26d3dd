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
from test_chaos import MAX_TOKENS, worker_kill_case

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


FAULTS = {  # victim -> its row in the report
    "decode": "SIGKILL decode (of 2), Kafka",
    "prefill": "SIGKILL prefill (of 1), Kafka",
    "batcher": "SIGKILL batcher, Kafka",
    "kvpool": "SIGKILL kvpool, Kafka",
}


@pytest.mark.parametrize("victim", list(FAULTS))
def test_sigkill_mid_load_on_kafka(
    victim: str, kafka_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    worker_kill_case(kafka_stack, victim, FAULTS[victim], reference, chaos_rows)
