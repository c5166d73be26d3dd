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


# (fault, inject, recovery limit): the kvpool's recovery can be dominated by transfers under way to the
# dead pool ending only at their attempt timeout (docs/reliability.md), so it is reported, not bounded
KILLS: dict[str, tuple[str, Inject, float | None]] = {
    "decode": ("SIGKILL decode (of 1)", kill_decode_mid_decode, RECOVERY_LIMIT_S),
    "prefill": ("SIGKILL prefill (of 1), 1 decode", kill_prefill_mid_load, RECOVERY_LIMIT_S),
    "batcher": ("SIGKILL batcher, 1 decode", kill_batcher_mid_load, RECOVERY_LIMIT_S),
    "kvpool": ("SIGKILL kvpool, 1 decode", kill_kvpool_mid_load, None),
}


@pytest.mark.parametrize("victim", list(KILLS))
def test_sigkill_mid_load_with_one_decode_worker(
    victim: str, one_decode_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    fault, inject, recovery_limit_s = KILLS[victim]
    moved = migrations(one_decode_stack)
    result = asyncio.run(chaos_case(one_decode_stack, fault, inject))
    case = check(result, reference, chaos_rows, recovery_limit_s)
    assert case.completed == case.sent
    assert case.recovery_s is not None, "the stack never served again"
    if victim == "decode":
        assert migrations(one_decode_stack) > moved, "the victim held no request: the fault missed the load"
