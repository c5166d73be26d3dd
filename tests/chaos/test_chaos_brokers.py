"""The broker lost mid-load: Redis restarted, SIGKILLed or flushed, or tansu SIGKILLed, on a broker of the
suite's own (chaos_brokers.py) under the same stack and load as test_chaos.py, with the same checks: 0 hung,
0 malformed, 0 duplicated or missing tokens, 0 leaked KV blocks.

The broker keeps no data here, so a loss takes the messages not yet handled with it. Publishes ride
out the outage; the consume loops reconnect and re-create their streams (topics) and groups; the gateway
hears of the loss and migrates its unfinished requests (what it sent may be gone). A request in flight
may also end with a well-formed error. The broker must be in use again within BACK_IN_USE_S of its return.
`make test` runs the Redis restart; `make chaos` (CHAOS_ALL=1) every case.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from chaos_brokers import DOWN_S, PrivateBroker
from chaos_load import Row, references
from chaos_stack import STACK_ENV, ChaosStack, run_all, start_stack
from test_chaos import MAX_TOKENS, busy_decode, chaos_case, check, migrations

pytestmark = pytest.mark.slow
full_suite_only = pytest.mark.skipif(not run_all(), reason="in `make chaos` only (CHAOS_ALL=1)")

BACK_IN_USE_S = 10.0  # from the broker's return until a new request completes
CONSUMERS = ("gateway", "prefill-0", "batcher-0", "kvpool-0", "decode-0", "decode-1")


# class scope: each test class (its KIND) gets one broker and stack, stopped before the next class starts
@pytest.fixture(scope="class")
def broker(request: pytest.FixtureRequest) -> Iterator[PrivateBroker]:
    started = PrivateBroker.start(request.cls.KIND)
    yield started
    started.stop()


@pytest.fixture(scope="class")
def stack(broker: PrivateBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    started = start_stack(
        broker.url, Path(tmp_path_factory.mktemp(f"chaos-{broker.kind}")), decode=2, env=STACK_ENV
    )
    yield started
    started.stop()


@pytest.fixture(scope="class")
def reference(stack: ChaosStack) -> dict[str, str]:
    return asyncio.run(references(stack.url, MAX_TOKENS))


def log_text(stack: ChaosStack, service: str) -> str:
    return stack.services[service].log_path.read_text(errors="replace")


def broker_loss_case(
    stack: ChaosStack, fault: str, lose: Callable[[], float], down_s: float, reference: dict[str, str],
    rows: list[Row],
) -> Row:  # fmt: skip
    """Strike once a decode worker is mid-request; the shared checks, the recovery bound, the log lines."""
    moved = migrations(stack)

    async def inject(s: ChaosStack) -> float:
        await busy_decode(s)
        return await asyncio.to_thread(lose)

    case = check(asyncio.run(chaos_case(stack, fault, inject)), reference, rows, recovery_limit_s=None)
    assert case.recovery_s is not None, "the stack never served again"
    assert case.recovery_s <= down_s + BACK_IN_USE_S, case
    gateway = log_text(stack, "gateway")
    assert '"bus_data_lost"' in gateway, "the gateway never heard of the loss"
    assert migrations(stack) > moved, "no in-flight request was redone after the loss"
    redone = [line for line in gateway.splitlines() if '"request_migrated"' in line and "bus_lost" in line]
    assert redone, "no request_migrated line for the loss"
    return case


# Redis fault -> (its row in the report, how the broker loses its data, seconds it stays away)
REDIS_FAULTS: dict[str, tuple[str, Callable[[PrivateBroker], float], float]] = {
    "restart": (f"Redis restart (SIGTERM, back after {DOWN_S:.0f} s, empty)",
                lambda broker: broker.restart(kill=False), DOWN_S),
    "sigkill": (f"Redis SIGKILL (back after {DOWN_S:.0f} s, empty)", lambda broker: broker.restart(kill=True), DOWN_S),
    "flushall": ("Redis FLUSHALL", lambda broker: broker.flushall(), 0.0),
}  # fmt: skip


class TestRedisLoss:
    KIND = "redis"

    @staticmethod
    def lost_streams_logged(stack: ChaosStack) -> None:
        """Each service's log says which streams and groups it found gone and made again."""
        silent = [s for s in CONSUMERS if "Redis lost stream" not in log_text(stack, s)]
        assert not silent, f"no loss logged by {silent}"

    @pytest.mark.parametrize(
        "fault", ["restart", pytest.param("sigkill", marks=full_suite_only),
                  pytest.param("flushall", marks=full_suite_only)],
    )  # fmt: skip
    def test_redis_loss_mid_load(
        self, fault: str, stack: ChaosStack, broker: PrivateBroker, reference: dict[str, str],
        chaos_rows: list[Row],
    ) -> None:  # fmt: skip
        row, lose, down_s = REDIS_FAULTS[fault]
        broker_loss_case(stack, row, lambda: lose(broker), down_s, reference, chaos_rows)
        self.lost_streams_logged(stack)


KAFKA_LOSS_LINES = ("the broker lost this group's commits", "gone from the broker")


@full_suite_only
class TestKafkaLoss:
    KIND = "kafka"

    def test_tansu_sigkill_mid_load(
        self, stack: ChaosStack, broker: PrivateBroker, reference: dict[str, str],
        chaos_rows: list[Row],
    ) -> None:  # fmt: skip
        broker_loss_case(stack, f"tansu SIGKILL (back after {DOWN_S:.0f} s, empty)",
                         lambda: broker.restart(kill=True), DOWN_S, reference, chaos_rows)  # fmt: skip
        # each service's log says which topics or group commits it found gone
        silent = [s for s in CONSUMERS if not any(line in log_text(stack, s) for line in KAFKA_LOSS_LINES)]
        assert not silent, f"no loss logged by {silent}"
