"""The kills of test_chaos.py on a stack with ONE decode worker: no second worker to move requests to.

A killed decode worker takes every running request's KV with it; its requests wait for the restarted
worker and are re-prefilled onto it (request migration: the gateway sees the worker restart, or its
heartbeat stop, and prefills each from its prompt plus the tokens already sent). A killed prefill,
kvpool or batcher is restarted as in test_chaos.py; what differs is that every request ends on the one
decode worker. The assertions are test_chaos.py's (`check`), and every request completes.

The stack runs under a deployment of its own on the chaos database (every Redis database has its
module already); it starts a stack of its own, so the module runs in `make chaos` (CHAOS_ALL=1) only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos_load import Row, references
from chaos_stack import ChaosStack, run_all, start_deployment_stack
from test_chaos import MAX_TOKENS, worker_kill_case

pytestmark = [
    pytest.mark.slow,
    # a skip mark, not a skip in the test: the module's stack is never started
    pytest.mark.skipif(not run_all(), reason="in `make chaos` only (CHAOS_ALL=1)"),
]

DEPLOYMENT = "chaos-one-decode"


@pytest.fixture(scope="module")
def one_decode_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    log_dir = Path(tmp_path_factory.mktemp("chaos-one-decode"))
    stack = start_deployment_stack(redis_url, log_dir, DEPLOYMENT, decode=1)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def reference(one_decode_stack: ChaosStack) -> dict[str, str]:
    return asyncio.run(references(one_decode_stack.url, MAX_TOKENS))


FAULTS = {  # victim -> its row in the report
    "decode": "SIGKILL decode (of 1)",
    "prefill": "SIGKILL prefill (of 1), 1 decode",
    "batcher": "SIGKILL batcher, 1 decode",
    "kvpool": "SIGKILL kvpool, 1 decode",
}


@pytest.mark.parametrize("victim", list(FAULTS))
def test_sigkill_mid_load_with_one_decode_worker(
    victim: str, one_decode_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    worker_kill_case(one_decode_stack, victim, FAULTS[victim], reference, chaos_rows)
