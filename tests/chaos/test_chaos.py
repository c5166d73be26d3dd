"""Faults injected into the running stack mid-load: every request ends with a complete response or a
well-formed error, no completed stream has a duplicated or missing token, no KV block stays held after
the load drains, and the stack serves again once the victim is back.

The stack (1 prefill, 2 decode workers, Redis) runs as processes with this harness as its supervisor:
it restarts a killed service after RESTART_DELAY_S, as `alignedserve up` or the kubelet would.
`make test` runs one case per fault class (kill, hang, client disconnect, overload); `make chaos` all.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable

import pytest
from chaos_load import (
    CLOSED,
    COMPLETED,
    ERROR,
    LEFT,
    Outcome,
    Row,
    p99_tpot_ms,
    recovered_after,
    references,
    row,
    run_load,
    wrong_streams,
)
from chaos_stack import MAX_INFLIGHT, ChaosStack, run_all

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
REQUESTS = 8
CONCURRENCY = 8
RESTART_DELAY_S = 1.0  # a supervisor's first backoff
PAUSE_S = 20.0  # SIGSTOP: a hung, not dead, worker
UNLOADED_REQUESTS = 4  # the burst case's unloaded TPOT: each prompt once, one request at a time
GATEWAY_KILL_TOKENS = 1500  # decoding would hold the KV long past the drain wait: only a cancel frees it
RECOVERY_LIMIT_S = 60.0
DRAIN_WAIT_S = 30.0
MID_LOAD_WAIT_S = 120.0
MID_DECODE_TOKENS = 32  # a decode victim has generated this many tokens (about 8 per request) when hit

Inject = Callable[[ChaosStack], Awaitable[float | None]]  # returns when the fault began (monotonic)


def full_suite_only() -> None:
    if not run_all():
        pytest.skip("in `make chaos` only (CHAOS_ALL=1)")


@pytest.fixture(scope="module")
def reference(chaos_stack: ChaosStack) -> dict[str, str]:
    return asyncio.run(references(chaos_stack.url, MAX_TOKENS))


# --- when to strike ---------------------------------------------------------------------------------


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + MID_LOAD_WAIT_S
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"never {what}"
        await asyncio.sleep(0.1)


def busiest_decode(stack: ChaosStack, since: dict[str, float], min_tokens: float) -> str | None:
    """The decode worker running the most requests, once one runs any and has generated `min_tokens`
    tokens since `since` (its counter then)."""
    running = {d: stack.metric(d, "alignedserve:decode_running_requests") for d in stack.names("decode")}
    busy = [d for d in running if running[d] > 0 and generated(stack, d) - since[d] >= min_tokens]
    return max(busy, key=lambda d: (running[d], d)) if busy else None


def generated(stack: ChaosStack, decode: str) -> float:
    return stack.metric(decode, "alignedserve:decode_generation_tokens_total")


# --- faults -----------------------------------------------------------------------------------------


async def kill_and_restart(stack: ChaosStack, service: str) -> float:
    """SIGKILL now, restart after the supervisor's delay; returns when it was killed."""
    await asyncio.to_thread(stack.kill, service)
    killed = time.monotonic()
    await asyncio.sleep(RESTART_DELAY_S)
    stack.restart(service)
    await asyncio.to_thread(stack.wait_ready, service)
    return killed


async def busy_decode(stack: ChaosStack, min_tokens: float = MID_DECODE_TOKENS) -> str:
    """A decode worker in the middle of its requests: some tokens out, more to come."""
    since = await asyncio.to_thread(lambda: {d: generated(stack, d) for d in stack.names("decode")})
    deadline = time.monotonic() + MID_LOAD_WAIT_S
    while (victim := await asyncio.to_thread(busiest_decode, stack, since, min_tokens)) is None:
        assert time.monotonic() < deadline, "no decode worker ever ran a request"
        await asyncio.sleep(0.05)
    return victim


async def kill_decode_mid_decode(stack: ChaosStack) -> float:
    return await kill_and_restart(stack, await busy_decode(stack))


async def kill_prefill_mid_load(stack: ChaosStack) -> float:
    await prompt_prefilled(stack)
    return await kill_and_restart(stack, "prefill-0")


async def kill_batcher_mid_load(stack: ChaosStack) -> float:
    # once a batch runs, the other requests wait in the batcher or are on their way to a worker
    await busy_decode(stack, min_tokens=0)
    return await kill_and_restart(stack, "batcher-0")


async def pause_and_resume(stack: ChaosStack, service: str) -> float:
    """SIGSTOP now, SIGCONT after PAUSE_S: hung, not dead; returns when it was paused."""
    stack.signal(service, signal.SIGSTOP)
    paused = time.monotonic()
    await asyncio.sleep(PAUSE_S)
    stack.signal(service, signal.SIGCONT)
    await asyncio.to_thread(stack.wait_ready, service)
    return paused


async def pause_decode_mid_decode(stack: ChaosStack) -> float:
    return await pause_and_resume(stack, await busy_decode(stack))


async def prompt_prefilled(stack: ChaosStack) -> None:
    before = stack.metric("prefill-0", "alignedserve:prompt_tokens_total")
    await until(lambda: stack.metric("prefill-0", "alignedserve:prompt_tokens_total") > before,
                "a prompt was prefilled")  # fmt: skip


async def pool_stored(stack: ChaosStack) -> None:
    # an entry lives only from its hand-off to its staging pull: strike once the first one was stored,
    # while the others of the load are on their way in or waiting there
    stored = "alignedserve:kv_pool_stored_total"
    before = stack.metric("kvpool-0", stored)
    await until(lambda: stack.metric("kvpool-0", stored) > before, "the pool stored KV")


async def pause_prefill_mid_load(stack: ChaosStack) -> float:
    await prompt_prefilled(stack)
    return await pause_and_resume(stack, "prefill-0")


async def pause_batcher_mid_load(stack: ChaosStack) -> float:
    await busy_decode(stack, min_tokens=0)
    return await pause_and_resume(stack, "batcher-0")


async def pause_kvpool_mid_load(stack: ChaosStack) -> float:
    await pool_stored(stack)
    return await pause_and_resume(stack, "kvpool-0")


async def all_decoding(stack: ChaosStack, requests: int) -> None:
    """Every request of the load runs on a decode worker (none waits in prefill, the pool or a buffer)."""

    def running() -> float:
        return sum(stack.metric(d, "alignedserve:decode_running_requests") for d in stack.names("decode"))

    await until(lambda: running() >= requests, f"{requests} requests decoding at once")


async def kill_gateway_mid_decode(stack: ChaosStack) -> float:
    await all_decoding(stack, REQUESTS)
    return await kill_and_restart(stack, "gateway")


async def kill_kvpool_mid_load(stack: ChaosStack) -> float:
    await pool_stored(stack)
    return await kill_and_restart(stack, "kvpool-0")


async def no_fault(_stack: ChaosStack) -> float | None:
    return None  # the clients themselves are the fault (they leave, or come all at once)


# --- the case ---------------------------------------------------------------------------------------


def leaked_blocks(stack: ChaosStack) -> int:
    """KV still held somewhere: pool entries, decode blocks in use, decode candidates, staged bytes."""
    pool = stack.metric("kvpool-0", "alignedserve:kv_pool_entries")
    held = sum(
        round(stack.metric(d, "alignedserve:decode_kv_usage_perc") * stack.total_blocks(d))
        + stack.metric(d, "alignedserve:decode_candidate_requests")
        for d in stack.names("decode")
    )
    staged = sum(stack.metric(p, "alignedserve:prefill_staged_bytes") > 0 for p in stack.names("prefill"))
    return int(pool + held + staged)


async def leaked_after_drain(stack: ChaosStack) -> int:
    deadline = time.monotonic() + DRAIN_WAIT_S
    while (leaked := await asyncio.to_thread(leaked_blocks, stack)) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return leaked


async def chaos_case(
    stack: ChaosStack,
    fault: str,
    inject: Inject,
    requests: int = REQUESTS,
    concurrency: int = CONCURRENCY,
    leave_after: Callable[[int], int | None] = lambda _i: None,
    max_tokens: int = MAX_TOKENS,
) -> tuple[Row, list[Outcome]]:
    load = asyncio.create_task(run_load(stack.url, requests, max_tokens, concurrency, leave_after))
    began = await inject(stack)
    recovery = None if began is None else await recovered_after(stack.url, began)
    outcomes = await load
    if began is None:
        assert await recovered_after(stack.url, time.monotonic()) is not None, "the stack serves no more"
    leaked = await leaked_after_drain(stack)
    return row(fault, outcomes, 0, leaked, recovery), outcomes


def check(
    result: tuple[Row, list[Outcome]],
    reference: dict[str, str],
    rows: list[Row],
    recovery_limit_s: float | None = RECOVERY_LIMIT_S,
    gateway_killed: bool = False,
) -> Row:
    """The assertions every case shares; records the row first, so a failing case is in the table.
    Only a case that kills the gateway accepts streams whose connection closed (CLOSED)."""
    case, outcomes = result
    case.wrong_tokens = len(wrong_streams(outcomes, reference, MAX_TOKENS))
    rows.append(case)
    accepted = (COMPLETED, ERROR, LEFT, CLOSED) if gateway_killed else (COMPLETED, ERROR, LEFT)
    ends = [(o.end, o.status, o.detail) for o in outcomes if o.end not in accepted]
    assert not ends, ends
    assert case.wrong_tokens == 0, [
        (o.prompt, o.text) for o in wrong_streams(outcomes, reference, MAX_TOKENS)
    ]
    assert case.leaked_blocks == 0, "KV blocks still held after the load drained"
    if recovery_limit_s is not None:
        assert case.recovery_s is None or case.recovery_s <= recovery_limit_s, case
    return case


def migrations(stack: ChaosStack) -> float:
    return stack.metric("gateway", "alignedserve:request_migrations_total")


# The worker kills other stacks repeat (one decode worker, the Kafka bus): victim -> its inject and
# recovery bound; a dead kvpool's recovery can be dominated by transfers under way to it ending only at
# their attempt timeout (docs/reliability.md), so it is reported, not bounded.
WORKER_KILLS: dict[str, tuple[Inject, float | None]] = {
    "decode": (kill_decode_mid_decode, RECOVERY_LIMIT_S),
    "prefill": (kill_prefill_mid_load, RECOVERY_LIMIT_S),
    "batcher": (kill_batcher_mid_load, RECOVERY_LIMIT_S),
    "kvpool": (kill_kvpool_mid_load, None),
}


def worker_kill_case(
    stack: ChaosStack, victim: str, fault: str, reference: dict[str, str], rows: list[Row]
) -> None:
    """SIGKILL of one worker mid-load: every request completes, and the stack serves again."""
    inject, recovery_limit_s = WORKER_KILLS[victim]
    moved = migrations(stack)
    case = check(asyncio.run(chaos_case(stack, fault, inject)), reference, rows, recovery_limit_s)
    assert case.completed == case.sent
    assert case.recovery_s is not None, "the stack never served again"
    if victim == "decode":
        assert migrations(stack) > moved, "the victim held no request: the fault missed the load"


def test_sigkill_of_a_decode_worker_mid_decode(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    moved = migrations(chaos_stack)
    result = asyncio.run(chaos_case(chaos_stack, "SIGKILL decode (of 2)", kill_decode_mid_decode))
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent
    assert migrations(chaos_stack) > moved, "the victim held no request: the fault missed the load"


def test_sigstop_of_a_decode_worker_for_20_s(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    moved = migrations(chaos_stack)
    result = asyncio.run(chaos_case(chaos_stack, "SIGSTOP decode (of 2) 20 s", pause_decode_mid_decode))
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent
    assert migrations(chaos_stack) > moved, "the silent worker's requests moved to the live one"


def test_half_the_clients_disconnect_mid_stream(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    result = asyncio.run(chaos_case(chaos_stack, "clients disconnect mid-stream (half)", no_fault,
                                    leave_after=lambda i: 4 if i % 2 == 0 else None))  # fmt: skip
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent // 2 and sum(o.end == LEFT for o in result[1]) == case.sent // 2


def test_a_burst_of_5x_the_admission_limit_gets_only_200s_and_429s(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    burst = 5 * MAX_INFLIGHT
    unloaded = asyncio.run(run_load(chaos_stack.url, UNLOADED_REQUESTS, MAX_TOKENS, concurrency=1))
    unloaded_p99 = p99_tpot_ms(unloaded)
    assert unloaded_p99 is not None, [(o.end, o.detail) for o in unloaded]
    result = asyncio.run(chaos_case(chaos_stack, f"burst of {burst} (5x admission limit)", no_fault,
                                    requests=burst, concurrency=burst))  # fmt: skip
    admitted_p99 = p99_tpot_ms(result[1])
    assert admitted_p99 is not None
    result[
        0
    ].note = f"admitted P99 TPOT {admitted_p99:.0f} ms (unloaded, one at a time: {unloaded_p99:.0f} ms)"
    case = check(result, reference, chaos_rows)
    statuses = sorted({o.status for o in result[1]}, key=str)
    assert statuses in ([200], [200, 429]), statuses
    assert all(o.end == COMPLETED for o in result[1] if o.status == 200)
    assert case.completed >= 1  # the admitted ones (their number is the gateway's limits' business)


def test_sigkill_of_the_prefill_worker_mid_load(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    full_suite_only()
    result = asyncio.run(chaos_case(chaos_stack, "SIGKILL prefill (of 1)", kill_prefill_mid_load))
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent


def test_sigkill_of_the_batcher_mid_load(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    full_suite_only()
    result = asyncio.run(chaos_case(chaos_stack, "SIGKILL batcher", kill_batcher_mid_load))
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent


def test_sigkill_of_the_kvpool_mid_load(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    full_suite_only()
    result = asyncio.run(chaos_case(chaos_stack, "SIGKILL kvpool", kill_kvpool_mid_load))
    case = check(result, reference, chaos_rows, recovery_limit_s=None)
    assert case.completed == case.sent
    assert case.recovery_s is not None, "the stack never served again"
    if case.recovery_s > RECOVERY_LIMIT_S:
        # Hand-offs and pulls that were on their way to the dead pool keep its old address and fail one
        # after another at the transfer layer's connect timeout before their requests are re-prefilled.
        pytest.xfail(
            f"recovery took {case.recovery_s:.0f} s: in-flight transfers to a dead kvpool fail slowly"
        )


def test_sigstop_of_the_prefill_worker_for_20_s(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    full_suite_only()
    result = asyncio.run(chaos_case(chaos_stack, "SIGSTOP prefill (of 1) 20 s", pause_prefill_mid_load))
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent


def test_sigstop_of_the_batcher_for_20_s(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    full_suite_only()
    result = asyncio.run(chaos_case(chaos_stack, "SIGSTOP batcher 20 s", pause_batcher_mid_load))
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent


def test_sigstop_of_the_kvpool_for_20_s(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    full_suite_only()
    result = asyncio.run(chaos_case(chaos_stack, "SIGSTOP kvpool 20 s", pause_kvpool_mid_load))
    case = check(result, reference, chaos_rows)
    assert case.completed == case.sent


def orphaned(stack: ChaosStack) -> float:
    return sum(stack.metric(d, "alignedserve:decode_orphaned_requests_total") for d in stack.names("decode"))


def test_sigkill_of_the_gateway_cancels_its_requests_downstream(
    chaos_stack: ChaosStack, reference: dict[str, str], chaos_rows: list[Row]
) -> None:
    """Its clients see the connection close (CLOSED); the decode workers cancel the requests of the dead
    process (services/decode gateways.py) long before they would have finished; the restarted gateway
    serves."""
    full_suite_only()
    before = orphaned(chaos_stack)
    result = asyncio.run(chaos_case(chaos_stack, "SIGKILL gateway", kill_gateway_mid_decode,
                                    max_tokens=GATEWAY_KILL_TOKENS))  # fmt: skip
    case = check(result, reference, chaos_rows, gateway_killed=True)
    assert case.closed == case.sent, [(o.end, o.detail) for o in result[1]]
    assert case.recovery_s is not None, "the restarted gateway never served"
    assert orphaned(chaos_stack) - before >= case.sent, "the decode workers did not cancel the requests"
