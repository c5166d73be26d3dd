"""DecodeCore: plans and prefetch notices in, scheduler state and messages out (pure; the real
per-iteration scheduler on top)."""

from __future__ import annotations

from dataclasses import dataclass, field

from alignedserve.batching.scheduler import plan_iteration
from alignedserve.bus import topics
from alignedserve.bus.messages import (
    BatchPlan,
    CandidateBuffer,
    FinishReason,
    KvLocation,
    PlannedRequest,
    PrefetchDone,
    RequestEvicted,
    RequestFinished,
    RequestLost,
    RequestState,
    SamplingSpec,
    ServiceKind,
    TokenBatch,
)
from alignedserve.decode.core import DecodeCore, running_profile

POOL = KvLocation(worker_id="kvpool-0", kind=ServiceKind.KVPOOL, ucx_address_key="127.0.0.1:4000")
STAGE = KvLocation(worker_id="prefill-0", kind=ServiceKind.PREFILL, ucx_address_key="127.0.0.1:4001")


def state(gateway: str = "gw", prompt_len: int = 10, logprobs: int | None = None) -> RequestState:
    return RequestState(
        gateway_id=gateway,
        sampling=SamplingSpec(logprobs=logprobs),
        prompt_len=prompt_len,
        output_len=1,
        recent_token_ids=(7,),
    )


def planned(rid: str, prefix: int, gateway: str = "gw", logprobs: int | None = None) -> PlannedRequest:
    return PlannedRequest(
        request_id=rid,
        prefix_len=prefix,
        blocks=-(-prefix // 4),
        location=POOL,
        state=state(gateway, prefix, logprobs),
        arrival=1.0,
    )


def plan(batch_id: int, *requests: PlannedRequest, staging: str = "", buffer: CandidateBuffer = CandidateBuffer.BATCH,
         worker: str = "decode-0") -> BatchPlan:  # fmt: skip
    return BatchPlan(batch_id=batch_id, decode_worker_id=worker, staging_worker_id=staging, buffer=buffer,
                     requests=requests)  # fmt: skip


def done(batch_id: int, ready: tuple[str, ...], failed: tuple[str, ...] = ()) -> PrefetchDone:
    return PrefetchDone(batch_id=batch_id, staging_worker_id="prefill-0", decode_worker_id="decode-0",
                        buffer=CandidateBuffer.BATCH, ready=ready, failed=failed, location=STAGE)  # fmt: skip


@dataclass(frozen=True)
class Running:  # what the engine reports (RunningInfo)
    request_id: str
    num_computed: int
    num_blocks: int


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Output:  # what an engine step returns (RequestOutput)
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None


def core() -> DecodeCore:
    return DecodeCore("decode-0", block_size=4, max_batch=8)


def test_a_pool_plan_is_ready_at_once_and_the_idle_scheduler_admits_it() -> None:
    c = core()
    c.on_plan(plan(5, planned("a", 9), planned("b", 12)))
    assert c.latest_batch_id == 5 and c.candidate_counts == (0, 2)
    s = c.iteration_state([], free_blocks=100)
    assert [(r.request_id, r.prefix_len, r.blocks, r.batch_id) for r in s.candidate_batch] == [
        ("a", 9, 3, 5),
        ("b", 12, 3, 5),
    ]
    decided = plan_iteration(s)
    assert decided.admitted == ("a", "b") and decided.admitted_from == "batch"
    for rid in decided.admitted:
        c.admitted(rid)
    assert c.running_ids == ["a", "b"] and c.candidate_counts == (0, 0)
    running = [Running("a", 9, 3), Running("b", 12, 4)]
    assert c.iteration_state(running, 93).running[1].batch_id == 5


def test_staged_candidates_wait_for_prefetch_done_which_may_overtake_the_plan() -> None:
    c = core()
    assert c.on_prefetch_done(done(3, ("a",))) == []  # before its plan: kept
    c.on_plan(plan(3, planned("a", 9), planned("b", 9), staging="prefill-0"))
    batch = c.iteration_state([], 100).candidate_batch
    assert [r.request_id for r in batch] == ["a"]  # b is still being staged
    assert c.candidate("a") is not None and c.candidate("a").location == STAGE  # type: ignore[union-attr]
    c.on_prefetch_done(done(3, ("b",)))
    assert len(c.iteration_state([], 100).candidate_batch) == 2


def test_a_failed_prefetch_loses_the_request_to_its_gateway_which_re_prefills_it() -> None:
    c = core()
    c.on_plan(plan(3, planned("a", 9, gateway="gw-1"), staging="prefill-0"))
    out = c.on_prefetch_done(done(3, (), failed=("a",)))
    assert [topic for topic, _ in out] == [topics.EVENTS]
    message = out[0][1]
    assert isinstance(message, RequestLost) and (message.request_id, message.worker_id) == ("a", "decode-0")
    assert "prefill-0" in message.reason
    assert c.candidate_counts == (0, 0)
    c.on_plan(plan(4, planned("a", 9)))  # a late plan cannot revive it: it lives on under another id
    assert c.candidate_counts == (0, 0)
    assert c.lose("a", "again") == [] and c.lose("unknown", "never here") == []
    assert c.on_prefetch_done(done(5, (), failed=("b",))) == []  # overtook its plan: kept until it comes
    [(topic, lost)] = c.on_plan(plan(5, planned("b", 9), staging="prefill-0"))
    assert topic == topics.EVENTS and isinstance(lost, RequestLost) and lost.request_id == "b"


def test_a_running_request_is_lost_or_failed_once_and_forgotten() -> None:
    c = core()
    c.on_plan(plan(3, planned("a", 9), planned("b", 9)))
    c.admitted("a")
    c.admitted("b")
    [(topic, lost)] = c.lose("a", "decode worker stopped before the request finished")
    assert topic == topics.EVENTS and isinstance(lost, RequestLost)
    failed = c.fail("b", "request refused: too long")  # a genuine error: the client gets it
    assert [topic for topic, _ in failed] == [topics.tokens("gw"), topics.EVENTS]
    assert isinstance(failed[0][1], RequestFinished) and failed[0][1].finish_reason is FinishReason.ERROR
    assert c.running_ids == [] and c.fail("a", "x") == [] and c.lose("b", "x") == []


def test_redelivered_and_foreign_plans_change_nothing() -> None:
    c = core()
    c.on_plan(plan(3, planned("a", 9)))
    c.on_plan(plan(3, planned("a", 9)))
    c.on_plan(plan(9, planned("z", 9), worker="decode-1"))
    assert c.candidate_counts == (0, 1) and c.latest_batch_id == 3


def test_one_token_batch_per_gateway_then_finished_messages() -> None:
    c = core()
    c.on_plan(plan(1, planned("a", 9, "gw-1"), planned("b", 9, "gw-2"), planned("c", 9, "gw-1")))
    for rid in ("a", "b", "c"):
        c.admitted(rid)
    outputs = [
        Output("a", [11], [7, 11]),
        Output("b", [12], [7, 12], finished=True, finish_reason="length"),
        Output("c", [13], [7, 9, 13], finished=True, finish_reason="stop"),
    ]
    out = c.on_outputs(outputs, iteration=4)
    assert [topic for topic, _ in out] == [
        topics.tokens("gw-1"),
        topics.tokens("gw-2"),
        topics.tokens("gw-2"),
        topics.EVENTS,
        topics.tokens("gw-1"),
        topics.EVENTS,
    ]
    first = out[0][1]
    assert isinstance(first, TokenBatch) and first.iteration == 4
    assert [(e.request_id, e.first_index, e.token_ids, e.finish_reason) for e in first.entries] == [
        ("a", 1, (11,), None),
        ("c", 2, (13,), FinishReason.STOP),
    ]
    finished = out[2][1]
    assert isinstance(finished, RequestFinished) and finished.request_id == "b"
    assert finished.finish_reason is FinishReason.LENGTH and finished.completion_tokens == 2
    assert c.running_ids == ["a"]


def test_logprobs_go_with_the_new_tokens_when_asked() -> None:
    c = core()
    c.on_plan(plan(1, planned("a", 9, logprobs=1)))
    c.admitted("a")
    [(_, batch)] = c.on_outputs([Output("a", [5], [7, 5], logprobs=[Logprob(5, -0.5, [(5, -0.5)])])], 1)
    assert isinstance(batch, TokenBatch)
    entry = batch.entries[0]
    assert entry.logprobs == (-0.5,) and entry.top_logprobs is not None
    assert entry.top_logprobs[0].token_ids == (5,)


def test_an_evicted_request_goes_to_its_staging_worker_and_stays_a_candidate() -> None:
    c = core()
    c.on_plan(plan(2, planned("a", 9), staging="prefill-0"))
    c.on_prefetch_done(done(2, ("a",)))
    c.admitted("a")
    assert c.eviction_target("a") == STAGE
    out = c.evicted("a", 20, [7, 1, 2, 3], STAGE, CandidateBuffer.REQUESTS)
    [(topic, message)] = out
    assert topic == topics.staging("prefill-0")
    assert isinstance(message, RequestEvicted) and message.to is CandidateBuffer.REQUESTS
    assert message.prefix_len == 20 and message.blocks == 5 and message.batch_id == 2
    assert message.state.output_len == 4 and message.state.recent_token_ids == (7, 1, 2, 3)
    s = c.iteration_state([], 100)
    assert [(r.request_id, r.prefix_len, r.batch_id) for r in s.candidate_requests] == [("a", 20, 2)]


def test_eviction_back_to_the_pool_hands_the_request_to_the_batcher() -> None:
    c = core()
    c.on_plan(plan(2, planned("a", 9)))
    c.admitted("a")
    assert c.eviction_target("a") is None  # prefetch off: no staging worker
    [(topic, message)] = c.evicted("a", 12, [7, 1, 2], POOL, None)
    assert topic == topics.BATCHER and isinstance(message, RequestEvicted) and message.to is None
    assert not c.knows("a")


def test_cancel_drops_a_candidate_and_aborts_a_running_request() -> None:
    c = core()
    c.on_plan(plan(1, planned("a", 9), planned("b", 9)))
    c.admitted("a")
    c.on_gone("a")
    c.on_gone("b")
    assert c.candidate_counts == (0, 0)
    assert c.take_aborts() == ["a"] and c.take_aborts() == []
    assert c.running_ids == []
    assert c.on_outputs([Output("a", [3], [7, 3])], 1) == []  # its last step's tokens are dropped


def test_the_requests_of_a_gone_gateway_are_dropped_and_cancelled_everywhere() -> None:
    c = core()
    c.on_plan(plan(1, planned("a", 9, gateway="dead"), planned("b", 9), planned("c", 9, gateway="dead")))
    c.admitted("a")
    cancels = c.orphan({"dead"}, "gateway dead restarted")
    assert [(m.request_id, m.reason) for m in cancels] == [
        ("c", "gateway dead restarted"),
        ("a", "gateway dead restarted"),
    ]
    assert c.take_aborts() == ["a"] and c.candidate_counts == (0, 1) and c.knows("b")
    assert c.orphan({"dead"}, "again") == []  # gone once: a later sweep sends nothing more
    c.on_plan(plan(2, planned("a", 9, gateway="dead")))
    assert not c.knows("a")  # a late plan of a cancelled request cannot revive it


def test_status_reports_room_range_candidates_and_the_latest_plan() -> None:
    c = core()
    c.on_plan(plan(1, planned("a", 9), planned("b", 30)))
    c.on_plan(plan(2, planned("c", 31), buffer=CandidateBuffer.REQUESTS))
    c.admitted("a")
    c.admitted("b")
    first = c.status(50, 100, [Running("a", 9, 3), Running("b", 30, 8)])
    assert (first.running, first.prefix_lo, first.prefix_hi, first.idle) == (2, 9, 30, False)
    assert (first.candidate_requests, first.candidate_batch, first.latest_batch_id) == (1, 0, 2)
    second = c.status(100, 100, [])
    assert second.seq > first.seq and second.idle and (second.prefix_lo, second.prefix_hi) == (0, 0)


def test_profile_counts_origin_batches() -> None:
    c = core()
    c.on_plan(plan(1, planned("a", 9)))
    c.on_plan(plan(2, planned("b", 40)))
    c.admitted("a")
    c.admitted("b")
    profile = c.profile([Running("a", 9, 3), Running("b", 40, 11)])
    assert (profile.lo, profile.hi, profile.spread, profile.batches) == (9, 40, 31, 2)
    assert running_profile([], []).batches == 0
