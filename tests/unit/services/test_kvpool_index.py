"""PoolIndex (what the kvpool re-announces to a restarted batcher), and what a re-announced KvReady does
to a batcher that already knows the request (pure; the real aligned policy underneath)."""

from __future__ import annotations

import dataclasses

from alignedserve.batcher.core import BatcherCore, BatcherRules
from alignedserve.batching.policies import make_policy
from alignedserve.bus.messages import (
    BatchPlan,
    CandidateBuffer,
    DecodeStatus,
    KvLocation,
    KvReady,
    PlannedRequest,
    RequestEvicted,
    RequestState,
    SamplingSpec,
    ServiceKind,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.kvpool.index import PoolIndex, request_states

POOL = KvLocation(worker_id="kvpool-0", kind=ServiceKind.KVPOOL, ucx_address_key="pool-address")
ELSEWHERE = KvLocation(worker_id="prefill-0", kind=ServiceKind.PREFILL, ucx_address_key="prefill-address")
STATE = RequestState(
    gateway_id="gw", sampling=SamplingSpec(max_tokens=8), prompt_len=30, output_len=1, recent_token_ids=(7,)
)


def ready(rid: str, prefix: int = 31, location: KvLocation = POOL) -> KvReady:
    return KvReady(request_id=rid, prefix_len=prefix, blocks=2, location=location, state=STATE, arrival=100.0)


def evicted(rid: str, to: CandidateBuffer | None, location: KvLocation = POOL) -> RequestEvicted:
    return RequestEvicted(
        request_id=rid, decode_worker_id="decode-0", batch_id=5, to=to, prefix_len=40, blocks=3,
        location=location, state=STATE, arrival=90.0,
    )  # fmt: skip


def plan(*rids: str) -> BatchPlan:
    planned = tuple(
        PlannedRequest(request_id=r, prefix_len=31, blocks=2, location=POOL, state=STATE, arrival=100.0)
        for r in rids
    )
    return BatchPlan(batch_id=1, decode_worker_id="decode-0", staging_worker_id="prefill-0",
                     buffer=CandidateBuffer.BATCH, requests=planned)  # fmt: skip


def batcher_beat(started_at: float, state: WorkerState = WorkerState.STARTING) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        kind=ServiceKind.BATCHER, worker_id="batcher-0", state=state, seq=1, started_at=started_at
    )


def test_a_new_batcher_incarnation_gets_every_held_unplanned_entry_again_under_new_ids() -> None:
    index, held = PoolIndex("kvpool-0"), {"a", "b", "c", "d", "e"}
    originals = [ready("a"), ready("b"), ready("c"), ready("elsewhere", location=ELSEWHERE)]
    for message in originals:
        index.on_batcher_topic(message, held)
    index.on_batcher_topic(evicted("d", to=None), held)  # back to the pool: batchable
    index.on_batcher_topic(evicted("e", to=CandidateBuffer.REQUESTS), held)  # a decode worker's candidate
    index.on_batcher_topic(plan("c"), held)  # the running batcher planned it: not offered again
    held.discard("b")  # pulled meanwhile

    again = index.on_heartbeat(batcher_beat(started_at=1.0), held, now=500.0)

    assert sorted(m.request_id for m in again) == ["a", "d"]
    assert all(isinstance(m, KvReady) for m in again)
    by_id = {m.request_id: m for m in again}
    assert by_id["a"].message_id != originals[0].message_id and by_id["a"].created_at == 500.0
    assert (by_id["a"].prefix_len, by_id["a"].location, by_id["a"].arrival) == (31, POOL, 100.0)
    assert (by_id["d"].prefix_len, by_id["d"].blocks, by_id["d"].arrival) == (40, 3, 90.0)
    assert len(index) == 2  # the pulled one is pruned


def test_only_a_batcher_start_not_seen_before_triggers_it() -> None:
    index, held = PoolIndex("kvpool-0"), {"a"}
    index.on_batcher_topic(ready("a"), held)
    assert len(index.on_heartbeat(batcher_beat(1.0), held, now=1.0)) == 1
    assert index.on_heartbeat(batcher_beat(1.0, WorkerState.READY), held, now=2.0) == []  # same process
    assert index.on_heartbeat(batcher_beat(0.5), held, now=3.0) == []  # a late beat of an older one
    assert index.on_heartbeat(batcher_beat(9.0, WorkerState.STOPPED), held, now=4.0) == []
    prefill = WorkerHeartbeat(kind=ServiceKind.PREFILL, worker_id="p", state=WorkerState.READY, seq=1,
                              started_at=9.0)  # fmt: skip
    assert index.on_heartbeat(prefill, held, now=5.0) == []
    assert len(index.on_heartbeat(batcher_beat(2.0), held, now=6.0)) == 1  # restarted


def test_a_plan_that_overtakes_its_announcement_still_counts_and_an_eviction_to_the_pool_unplans() -> None:
    index, held = PoolIndex("kvpool-0"), {"a"}
    index.on_batcher_topic(plan("a"), held)
    index.on_batcher_topic(ready("a"), held)  # arrives after its plan (another Kafka partition)
    assert "a" not in index
    index.on_batcher_topic(evicted("a", to=None), held)  # later back in the pool on purpose
    assert "a" in index
    index.forget("a")  # released, cancelled or finished
    assert index.on_heartbeat(batcher_beat(1.0), held, now=1.0) == []


def test_an_announcement_of_an_entry_no_longer_here_replaces_an_older_one() -> None:
    index, held = PoolIndex("kvpool-0"), {"a"}
    index.on_batcher_topic(ready("a"), held)
    index.on_batcher_topic(evicted("a", to=None, location=ELSEWHERE), held)
    assert "a" not in index
    index.on_batcher_topic(ready("b"), held)  # not served here (already pulled): nothing to keep
    assert "b" not in index


def batcher() -> BatcherCore:
    rules = BatcherRules(min_batch=1, max_batch=8, fill=1.0, prefetch=True, dynamic_prefetch=False,
                         range_slack=0)  # fmt: skip
    core = BatcherCore(make_policy("aligned", max_len=4096, leaf_width=16), rules)
    core.set_staging_workers(["prefill-0"])
    return core


def idle(seq: int, latest: int = 0) -> DecodeStatus:
    return DecodeStatus(worker_id="decode-0", seq=seq, free_blocks=100, total_blocks=100, running=0,
                        prefix_lo=0, prefix_hi=0, idle=True, latest_batch_id=latest)  # fmt: skip


def reannounced(message: KvReady) -> KvReady:
    index, held = PoolIndex("kvpool-0"), {message.request_id}
    index.on_batcher_topic(message, held)
    [again] = index.on_heartbeat(batcher_beat(1.0), held, now=1.0)
    return again


def test_a_reannounced_kv_ready_changes_nothing_for_a_request_the_batcher_holds_planned_or_saw_end() -> None:
    core = batcher()
    core.on_kv_ready(ready("waiting"), now=0.0)
    assert core.on_kv_ready(reannounced(ready("waiting")), now=0.0) == []
    assert core.waiting == 1  # held once
    [first] = core.on_status(idle(1), now=0.0)
    assert first.request_ids == ("waiting",)
    after = idle(2, latest=first.batch_id)
    assert core.on_status(after, now=0.0) == [] and core.waiting == 0
    assert core.on_kv_ready(reannounced(ready("waiting")), now=0.0) == []  # planned: not again
    core.on_request_gone("cancelled")
    assert core.on_kv_ready(reannounced(ready("cancelled")), now=0.0) == [] and core.waiting == 0


def test_the_requests_each_batcher_topic_message_is_about_with_their_state() -> None:
    labelled = dataclasses.replace(STATE, client_request_id="client-label")
    status = DecodeStatus(worker_id="decode-0", seq=1, free_blocks=1, total_blocks=2, running=0, prefix_lo=0,
                          prefix_hi=0, idle=True)  # fmt: skip
    assert request_states(dataclasses.replace(ready("r1"), state=labelled)) == [("r1", labelled)]
    assert request_states(evicted("r2", None)) == [("r2", STATE)]
    assert request_states(plan("r3", "r4")) == [("r3", STATE), ("r4", STATE)]
    assert request_states(status) == []
