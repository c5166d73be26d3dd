"""The decode worker's view of the gateways: which are gone, so that their requests are cancelled."""

from __future__ import annotations

from alignedserve.bus.messages import ServiceKind, WorkerHeartbeat, WorkerState
from alignedserve.decode.gateways import GatewayWatch

TIMEOUT_S = 4.0


def beat(seq: int, started_at: float = 100.0, state: WorkerState = WorkerState.READY,
         kind: ServiceKind = ServiceKind.GATEWAY, worker_id: str = "gw") -> WorkerHeartbeat:  # fmt: skip
    return WorkerHeartbeat(kind=kind, worker_id=worker_id, state=state, seq=seq, started_at=started_at)


def test_a_new_process_under_the_gateways_id_means_the_old_one_is_gone() -> None:
    watch = GatewayWatch(TIMEOUT_S)
    assert not watch.heard(beat(1), now=0.0)
    assert not watch.heard(beat(2), now=1.0)
    assert watch.heard(beat(1, started_at=200.0, state=WorkerState.STARTING), now=2.0)
    assert not watch.heard(beat(3), now=2.5)  # a late beat of the old process changes nothing


def test_a_stopped_gateway_is_gone_and_other_kinds_are_not_watched() -> None:
    watch = GatewayWatch(TIMEOUT_S)
    assert not watch.heard(beat(1, kind=ServiceKind.DECODE, state=WorkerState.STOPPED), now=0.0)
    watch.heard(beat(1), now=0.0)
    assert watch.heard(beat(2, state=WorkerState.STOPPED), now=1.0)
    assert watch.silent(now=60.0) == set()  # a stopped one said goodbye: it is not also silent


def test_a_gateway_silent_past_the_timeout_is_gone_until_it_beats_again() -> None:
    watch = GatewayWatch(TIMEOUT_S)
    watch.heard(beat(1), now=0.0)
    watch.heard(beat(1, worker_id="other"), now=0.0)
    for now in (1.0, 2.0, 3.0, 4.0):
        assert watch.silent(now) == set()
        watch.heard(beat(int(now) + 1, worker_id="other"), now)
    assert watch.silent(now=5.0) == {"gw"}
    watch.heard(beat(2), now=5.5)
    assert watch.silent(now=6.0) == set()


def test_a_pause_of_this_worker_is_not_the_gateways_silence() -> None:
    watch = GatewayWatch(TIMEOUT_S)
    watch.heard(beat(1), now=0.0)
    assert watch.silent(now=1.0) == set()
    assert watch.silent(now=21.0) == set()  # stopped for 20 s: the events backlog is not read yet
    watch.heard(beat(11), now=21.2)  # the backlog: the gateway beat on all along
    assert [watch.silent(now) for now in (22.0, 23.0, 24.0, 25.0)] == [set()] * 4
    assert watch.silent(now=25.5) == {"gw"}  # now it is silent while this worker runs
