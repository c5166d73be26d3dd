"""Worker liveness from heartbeats (pure): live and silent workers, restarts, late and reordered beats."""

from __future__ import annotations

import pytest

from alignedserve.bus.messages import ServiceKind, WorkerHeartbeat, WorkerState
from alignedserve.core import liveness
from alignedserve.core.liveness import Heard, Liveness

DECODE, PREFILL = ServiceKind.DECODE, ServiceKind.PREFILL


def beat(
    worker_id: str,
    kind: ServiceKind = DECODE,
    state: WorkerState = WorkerState.READY,
    seq: int = 1,
    started_at: float = 100.0,
) -> WorkerHeartbeat:
    return WorkerHeartbeat(kind=kind, worker_id=worker_id, state=state, seq=seq, started_at=started_at)


def test_the_state_names_are_the_wire_enums_values() -> None:
    names = (liveness.STARTING, liveness.READY, liveness.DRAINING, liveness.STOPPED)
    assert names == tuple(state.value for state in WorkerState)


def test_a_worker_is_live_while_its_ready_beat_is_fresh() -> None:
    workers: Liveness[ServiceKind] = Liveness()
    assert workers.heard(beat("d0"), now=0.0) is Heard.FIRST
    assert workers.heard(beat("p0", PREFILL), now=0.0) is Heard.FIRST
    assert workers.live(DECODE, now=5.0, timeout_s=5.0) == ["d0"]  # exactly timeout_s old: still live
    assert workers.live(DECODE, now=5.1, timeout_s=5.0) == []
    assert workers.live(PREFILL, now=1.0, timeout_s=5.0) == ["p0"]
    assert workers.heard(beat("d0", seq=2), now=5.1) is Heard.AGAIN
    assert workers.live(DECODE, now=6.0, timeout_s=5.0) == ["d0"]


@pytest.mark.parametrize("state", [WorkerState.STARTING, WorkerState.DRAINING, WorkerState.STOPPED])
def test_only_ready_workers_are_live(state: WorkerState) -> None:
    workers: Liveness[ServiceKind] = Liveness()
    workers.heard(beat("d0"), now=0.0)
    workers.heard(beat("d0", state=state, seq=2), now=1.0)
    assert workers.live(DECODE, now=1.0, timeout_s=5.0) == []
    assert "d0" in workers and len(workers) == 1


def test_silent_workers_are_those_not_heard_lately_and_not_stopped() -> None:
    workers: Liveness[ServiceKind] = Liveness()
    workers.heard(beat("d0"), now=0.0)
    workers.heard(beat("d1"), now=0.0)
    workers.heard(beat("d2", state=WorkerState.STOPPED), now=0.0)  # drained: handed its work back
    workers.heard(beat("p0", PREFILL, WorkerState.DRAINING), now=0.0)  # killed while draining
    workers.heard(beat("d0", seq=2), now=9.0)
    assert workers.silent(now=10.0, timeout_s=5.0) == {"d1": DECODE, "p0": PREFILL}
    assert workers.silent(now=10.0, timeout_s=5.0, kind=PREFILL) == {"p0": PREFILL}
    assert workers.silent(now=4.0, timeout_s=5.0) == {}


def test_late_beats_change_nothing() -> None:
    workers: Liveness[ServiceKind] = Liveness()
    workers.heard(beat("d0", seq=5), now=0.0)
    workers.heard(beat("d0", state=WorkerState.DRAINING, seq=6), now=1.0)
    assert workers.heard(beat("d0", seq=4), now=2.0) is Heard.LATE  # overtaken by seq 5 and 6
    assert workers.heard(beat("d0", seq=9, started_at=50.0), now=2.0) is Heard.LATE  # an older process
    seen = workers.get("d0")
    assert seen is not None and (seen.state, seen.seq, seen.heard_at) == (WorkerState.DRAINING, 6, 1.0)
    assert workers.heard(beat("d0", seq=6), now=3.0) is Heard.AGAIN  # a redelivered copy is no news


def test_a_newer_process_under_a_known_id_is_a_restart() -> None:
    workers: Liveness[ServiceKind] = Liveness()
    workers.heard(beat("d0", seq=40), now=0.0)
    assert workers.heard(beat("d0", seq=1, started_at=200.0), now=1.0) is Heard.RESTARTED
    assert workers.heard(beat("d0", seq=2, started_at=200.0), now=2.0) is Heard.AGAIN
    assert workers.heard(beat("d0", seq=41), now=3.0) is Heard.LATE  # the old process's last words


def test_a_starting_beat_is_never_late_within_one_process() -> None:
    # a restart within the clock's resolution (or without started_at) counts seq from 1 again
    workers: Liveness[ServiceKind] = Liveness()
    workers.heard(beat("d0", seq=40, started_at=0.0), now=0.0)
    starting = beat("d0", state=WorkerState.STARTING, seq=1, started_at=0.0)
    assert workers.heard(starting, now=1.0) is Heard.AGAIN
    assert workers.heard(beat("d0", seq=2, started_at=0.0), now=2.0) is Heard.AGAIN
    assert workers.live(DECODE, now=2.0, timeout_s=5.0) == ["d0"]


def test_a_forgotten_worker_is_heard_of_anew() -> None:
    workers: Liveness[ServiceKind] = Liveness()
    workers.heard(beat("d0", seq=7), now=0.0)
    workers.forget("d0")
    workers.forget("d0")  # idempotent
    assert "d0" not in workers and workers.get("d0") is None
    assert workers.silent(now=100.0, timeout_s=1.0) == {}
    assert workers.heard(beat("d0", seq=3), now=1.0) is Heard.FIRST
