"""BatcherCore: control messages in, batch plans out (pure; the real aligned policy underneath)."""

from __future__ import annotations

from alignedserve.batcher.core import BatcherCore, BatcherRules
from alignedserve.batching.policies import make_policy
from alignedserve.bus.messages import (
    CandidateBuffer,
    DecodeStatus,
    KvLocation,
    KvReady,
    RequestEvicted,
    RequestState,
    SamplingSpec,
    ServiceKind,
)

POOL = KvLocation(worker_id="kvpool-0", kind=ServiceKind.KVPOOL, ucx_address_key="kvpool-0")
STATE = RequestState(
    gateway_id="gw", sampling=SamplingSpec(), prompt_len=10, output_len=1, recent_token_ids=(5,)
)


def rules(**overrides: object) -> BatcherRules:
    base = dict(min_batch=2, max_batch=8, fill=1.0, prefetch=True, dynamic_prefetch=True, range_slack=0)
    base.update(overrides)
    return BatcherRules(**base)  # type: ignore[arg-type]


def core(**overrides: object) -> BatcherCore:
    c = BatcherCore(make_policy("aligned", max_len=4096, leaf_width=16), rules(**overrides))
    c.set_staging_workers(["prefill-0"])
    return c


def ready(rid: str, prefix: int, arrival: float = 0.0) -> KvReady:
    return KvReady(
        request_id=rid,
        prefix_len=prefix,
        blocks=-(-prefix // 16),
        location=POOL,
        state=STATE,
        arrival=arrival,
    )


def status(seq: int, *, idle: bool = True, free: int = 100, running: int = 0, lo: int = 0, hi: int = 0,
           cand_batch: int = 0, cand_requests: int = 0, latest: int = 0) -> DecodeStatus:  # fmt: skip
    return DecodeStatus(
        worker_id="decode-0", seq=seq, free_blocks=free, total_blocks=100, running=running, prefix_lo=lo,
        prefix_hi=hi, idle=idle, candidate_requests=cand_requests, candidate_batch=cand_batch,
        latest_batch_id=latest,
    )  # fmt: skip


def test_an_idle_worker_gets_what_is_waiting_staged_on_a_prefill_worker() -> None:
    c = core()
    assert c.on_kv_ready(ready("a", 100), now=1.0) == []  # no decode worker known yet
    [plan] = c.on_status(status(1), now=1.0)
    assert plan.buffer is CandidateBuffer.BATCH
    assert plan.staging_worker_id == "prefill-0" and plan.decode_worker_id == "decode-0"
    assert plan.request_ids == ("a",) and plan.requests[0].location == POOL
    assert c.waiting == 0


def test_no_second_batch_while_one_is_in_flight_or_staged() -> None:
    c = core()
    c.on_status(status(1), now=0.0)
    [first] = c.on_kv_ready(ready("a", 100), now=0.0)
    assert c.on_kv_ready(ready("b", 120), now=0.0) == []  # plan still in flight
    assert c.on_status(status(2, latest=first.batch_id, cand_batch=1), now=0.0) == []  # staged there
    [second] = c.on_status(status(3, latest=first.batch_id, cand_batch=0), now=0.0)
    assert second.request_ids == ("b",) and second.batch_id > first.batch_id


def test_a_saturated_worker_waits_for_a_full_batch_then_gets_the_aligned_pair() -> None:
    c = core(dynamic_prefetch=False)
    c.on_status(status(1, idle=False, running=8, lo=50, hi=60, cand_batch=0), now=0.0)
    assert c.on_kv_ready(ready("short", 40), now=0.0) == []  # 1 < K_min and no free slot (8 of 8 run)
    [plan] = c.on_kv_ready(ready("short2", 48), now=0.0)
    assert set(plan.request_ids) == {"short", "short2"}
    c.on_status(status(2, idle=False, running=8, lo=50, hi=60, cand_batch=2, latest=plan.batch_id), now=0.0)
    assert c.on_kv_ready(ready("long", 3000), now=0.0) == []  # its batch is staged: the next waits
    assert c.waiting == 1


def test_a_worker_with_free_slots_gets_what_waits_at_once() -> None:
    c = core(min_batch=4, max_batch=16, dynamic_prefetch=False)
    c.on_status(status(1, idle=False, running=10, lo=50, hi=60), now=0.0)
    [plan] = c.on_kv_ready(ready("far", 1000), now=0.0)  # out of range, alone; 10 running >= K_min
    assert plan.buffer is CandidateBuffer.BATCH and plan.request_ids == ("far",)
    full = core(min_batch=4, max_batch=16, dynamic_prefetch=False)
    full.on_status(status(1, idle=False, running=14, lo=50, hi=60, cand_requests=2), now=0.0)
    assert full.on_kv_ready(ready("far", 1000), now=0.0) == []  # 14 + 2 joining = max running: wait
    no_memory = core(min_batch=4, max_batch=16, dynamic_prefetch=False)
    no_memory.on_status(status(1, idle=False, running=10, free=10, lo=50, hi=60), now=0.0)
    assert no_memory.on_kv_ready(ready("far", 1000), now=0.0) == []  # its free blocks are its growth


def test_dynamic_prefetch_stages_requests_in_the_running_range() -> None:
    c = core(min_batch=8)
    c.on_kv_ready(ready("in", 500), now=0.0)
    c.on_kv_ready(ready("out", 2000), now=0.0)
    [plan] = c.on_status(status(1, idle=False, running=4, lo=480, hi=520, cand_batch=3), now=0.0)
    assert plan.buffer is CandidateBuffer.REQUESTS and plan.request_ids == ("in",)


def test_with_no_live_staging_worker_a_running_worker_gets_no_candidates_until_one_beats() -> None:
    c = core(min_batch=8)
    c.set_staging_workers([])  # the only prefill worker died
    c.on_kv_ready(ready("in", 500), now=0.0)
    assert c.on_status(status(1, idle=False, running=4, lo=480, hi=520, cand_batch=3), now=0.0) == []
    c.set_staging_workers(["prefill-0"])
    [plan] = c.dispatch(now=0.0)
    assert plan.buffer is CandidateBuffer.REQUESTS and plan.request_ids == ("in",)


def test_duplicates_and_cancellations_change_nothing() -> None:
    c = core()
    c.on_status(status(1), now=0.0)
    [plan] = c.on_kv_ready(ready("a", 100), now=0.0)
    assert c.on_kv_ready(ready("a", 100), now=0.0) == []  # redelivered after it was planned
    assert c.waiting == 0
    c.on_status(status(2, latest=plan.batch_id, idle=False, running=1, cand_batch=1), now=0.0)
    c.on_kv_ready(ready("b", 100), now=0.0)
    c.on_request_gone("b")
    assert c.waiting == 0
    assert c.on_status(status(1), now=0.0) == []  # an older report is ignored


def test_an_evicted_request_returns_to_the_pool_with_its_arrival() -> None:
    c = core()
    c.on_status(status(1), now=0.0)
    [plan] = c.on_kv_ready(ready("a", 100, arrival=3.0), now=3.0)
    evicted = RequestEvicted(
        request_id="a", decode_worker_id="decode-0", batch_id=plan.batch_id, to=None, prefix_len=140,
        blocks=9, location=POOL, state=STATE, arrival=3.0,
    )  # fmt: skip
    c.on_status(status(2, latest=plan.batch_id, idle=False, running=1, cand_batch=1), now=4.0)
    c.on_evicted_to_pool(evicted, now=4.0)
    assert c.waiting == 1
    [again] = c.on_status(status(3, latest=plan.batch_id, idle=True), now=5.0)
    assert again.requests[0].prefix_len == 140 and again.requests[0].arrival == 3.0


def test_prefetch_off_sends_plans_straight_to_decode_and_without_staging_workers_prefetch_waits() -> None:
    off = core(prefetch=False)
    off.on_status(status(1), now=0.0)
    [plan] = off.on_kv_ready(ready("a", 100), now=0.0)
    assert plan.staging_worker_id == ""
    on = BatcherCore(make_policy("aligned"), rules())
    on.on_status(status(1), now=0.0)
    assert on.on_kv_ready(ready("a", 100), now=0.0) == []
    on.set_staging_workers(["prefill-1"])
    [staged] = on.dispatch(now=0.0)
    assert staged.staging_worker_id == "prefill-1"
