"""The prefill worker's pure core: which prompts it takes, what it prefills together, what it does with a
staged request, where its hand-offs go, and the messages it publishes for each."""

from __future__ import annotations

from alignedserve.bus import topics
from alignedserve.bus.messages import (
    BatchPlan,
    CandidateBuffer,
    FinishReason,
    KvLocation,
    KvReady,
    PlannedRequest,
    PrefetchDone,
    PrefillRequest,
    RequestFinished,
    RequestLost,
    RequestState,
    SamplingSpec,
    ServiceKind,
    TokenBatch,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.engine.request import RequestOutput
from alignedserve.prefill.core import Intake, PrefillCore, Prefilled, ShortestFirst, Stage

BLOCK = 4
WORKER = "prefill-0"
POOL = KvLocation(worker_id="kvpool-0", kind=ServiceKind.KVPOOL, ucx_address_key="10.0.0.1:4000")


def core(max_tokens: int = 100, max_seqs: int = 8, max_queue: int = 3) -> PrefillCore:
    return PrefillCore(
        WORKER, BLOCK, max_prefill_tokens=max_tokens, max_num_seqs=max_seqs, max_queue=max_queue
    )


def prompt(rid: str, length: int, gateway: str = "gw-a", arrival: float = 0.0) -> PrefillRequest:
    return PrefillRequest(request_id=rid, model="tiny", prompt_token_ids=tuple(range(1, length + 1)),
                          sampling=SamplingSpec(), arrival=arrival, gateway_id=gateway)  # fmt: skip


def output(rid: str, tokens: list[int], reason: str | None = None) -> RequestOutput:
    return RequestOutput(rid, tokens, tokens, reason is not None, reason, None)


def ids(requests: list[PrefillRequest]) -> list[str]:
    return [r.request_id for r in requests]


def test_a_prompt_is_taken_once_and_an_ended_one_never() -> None:
    c = core()
    first = prompt("a", 5)
    assert c.is_new(first)
    c.take(first)
    assert not c.is_new(first)  # redelivered or re-published: prefilled once only
    c.end("b")
    assert not c.is_new(prompt("b", 5))
    assert ids(list(c.queue)) == ["a"]


def test_the_queue_is_full_at_max_queue_and_batches_take_the_oldest_within_budget() -> None:
    c = core(max_tokens=30, max_queue=3)
    for rid, n in (("a", 10), ("b", 15), ("c", 10)):
        c.take(prompt(rid, n))
    assert not c.has_room([])
    assert ids(c.next_batch(now=0.0)) == ["a", "b"]  # c would pass the 30-token budget
    assert c.has_room([]) and ids(list(c.queue)) == ["c"]


def shortest_core(max_tokens: int = 30, max_seqs: int = 8) -> PrefillCore:
    return PrefillCore(WORKER, BLOCK, max_tokens, max_seqs, max_queue=10, order=ShortestFirst(max_wait_s=2.0))


def test_shortest_first_takes_the_shortest_prompts_of_the_whole_queue_until_the_budget_is_reached() -> None:
    c = shortest_core(max_tokens=30)
    for rid, n in (("a", 40), ("b", 12), ("c", 5), ("d", 12), ("e", 9)):
        c.take(prompt(rid, n, arrival=10.0))
    # 5 + 9 + 12 = 26 < 30, so one more: the last taken may pass the budget (the engine chunks it)
    assert ids(c.next_batch(now=10.5)) == ["c", "e", "b", "d"]
    assert ids(list(c.queue)) == ["a"]
    assert ids(c.next_batch(now=10.6)) == ["a"]  # alone in the queue, a long prompt goes at once


def test_shortest_first_takes_overdue_prompts_first_oldest_first() -> None:
    c = shortest_core(max_tokens=30)
    c.take(prompt("new-short", 3, arrival=9.0))
    c.take(prompt("late-long", 50, arrival=7.5))
    c.take(prompt("later-long", 20, arrival=7.9))
    c.take(prompt("early-long", 60, arrival=7.0))
    # at 10.0 the three longs waited 2 s or more: oldest first, and 60 tokens fill the budget
    assert ids(c.next_batch(now=10.0)) == ["early-long"]
    assert ids(c.next_batch(now=10.0)) == ["late-long"]
    assert ids(c.next_batch(now=10.0)) == ["later-long", "new-short"]


def test_shortest_first_takes_at_most_max_seqs_prompts() -> None:
    c = shortest_core(max_tokens=1000, max_seqs=2)
    for rid in "abc":
        c.take(prompt(rid, 1))
    assert ids(c.next_batch(now=0.0)) == ["a", "b"]  # ties: first come
    assert ids(list(c.queue)) == ["c"]


def test_admission_drops_ended_fails_refused_and_defers_what_does_not_fit_together() -> None:
    c = core()
    c.take(prompt("z", 3))  # still queued: deferred requests go back ahead of it
    batch = [prompt("a", 11), prompt("gone", 3), prompt("bad", 3), prompt("b", 11), prompt("c", 3)]
    c.end("gone")
    # a needs 3 blocks (11 + 1 tokens), b 3 more, c 1: with 5 free, b waits and c still fits
    admission = c.admit(batch, free_blocks=5, refusals={"bad": "prompt too long", "gone": "ended anyway"})
    assert ids(admission.accepted) == ["a", "c"]
    assert [(r.request_id, why) for r, why in admission.refused] == [("bad", "prompt too long")]
    assert ids(list(c.queue)) == ["b", "z"]


def test_the_first_request_runs_even_beyond_the_free_blocks() -> None:
    c = core()
    admission = c.admit([prompt("a", 100), prompt("b", 3)], free_blocks=2, refusals={})
    assert ids(admission.accepted) == ["a"] and ids(list(c.queue)) == ["b"]  # the engine chunks a


def test_draining_hands_the_queue_back_as_new_messages() -> None:
    c = core()
    queued = [prompt("a", 3), prompt("b", 3)]
    for request in queued:
        c.take(request)
    handed = c.hand_back_queue(now=50.0)
    assert not c.queue and len(handed) == 2
    for (topic, again), before in zip(handed, queued, strict=True):
        assert topic == topics.PREFILL and isinstance(again, PrefillRequest)
        assert again.request_id == before.request_id and again.message_id != before.message_id
        assert again.created_at == 50.0  # consumers that saw the old message id drop it as a duplicate
    assert c.is_new(queued[0])  # it may come back here later


def test_first_tokens_go_to_each_gateway_with_a_new_iteration() -> None:
    c = core()
    done = [Prefilled(prompt("a", 3, "gw-1"), output("a", [7]), None),
            Prefilled(prompt("b", 3, "gw-2"), output("b", [8]), None)]  # fmt: skip
    first = c.first_tokens(done)
    assert [topic for topic, _ in first] == [topics.tokens("gw-1"), topics.tokens("gw-2")]
    assert all(isinstance(m, TokenBatch) and m.iteration == 1 and m.worker_id == WORKER for _, m in first)
    assert all(isinstance(m, TokenBatch) and m.iteration == 2 for _, m in c.first_tokens(done))


def test_a_request_ending_at_prefill_or_cancelled_meanwhile_is_finished_not_handed_off() -> None:
    c = core()
    ended = Prefilled(prompt("a", 5), output("a", [7], "length"), None)
    assert not c.hands_off(ended)
    (to_gateway, tokens_msg), (to_all, events_msg) = c.ended_at_prefill(ended)
    assert (to_gateway, to_all) == (topics.tokens("gw-a"), topics.EVENTS) and tokens_msg is events_msg
    assert isinstance(tokens_msg, RequestFinished) and tokens_msg.finish_reason is FinishReason.LENGTH
    assert (tokens_msg.prompt_tokens, tokens_msg.completion_tokens, tokens_msg.worker_id) == (5, 1, WORKER)
    running = Prefilled(prompt("b", 5), output("b", [7]), "kv")
    assert c.hands_off(running)
    c.end("b")
    assert not c.hands_off(running)
    ((_, aborted), _) = c.ended_at_prefill(running)
    assert isinstance(aborted, RequestFinished) and aborted.finish_reason is FinishReason.ABORT


def test_kv_ready_announces_the_pooled_kv_to_the_batcher() -> None:
    c = core()
    item = Prefilled(prompt("a", 9), output("a", [7]), "kv")
    ((topic, ready),) = c.kv_ready(item, num_tokens=9, location=POOL, now=12.5)
    assert topic == topics.BATCHER and isinstance(ready, KvReady)
    assert (ready.prefix_len, ready.blocks, ready.location, ready.arrival) == (9, 3, POOL, 12.5)
    assert ready.state == RequestState(gateway_id="gw-a", sampling=SamplingSpec(), prompt_len=9, output_len=1,
                                       recent_token_ids=(7,))  # fmt: skip
    ((_, failed), _) = c.failed(prompt("b", 4), "engine said no")
    assert isinstance(failed, RequestFinished) and failed.finish_reason is FinishReason.ERROR
    assert (failed.error, failed.completion_tokens) == ("engine said no", 0)


def planned(rid: str, holder: str = "kvpool-0") -> PlannedRequest:
    state = RequestState(
        gateway_id="gw-a", sampling=SamplingSpec(), prompt_len=3, output_len=1, recent_token_ids=(7,)
    )
    location = KvLocation(worker_id=holder, kind=ServiceKind.KVPOOL, ucx_address_key="10.0.0.1:4000")
    return PlannedRequest(request_id=rid, prefix_len=3, blocks=1, location=location, state=state, arrival=0.0)


def test_staging_pulls_skips_the_ended_and_keeps_what_is_here() -> None:
    c = core()
    c.end("gone")
    assert c.stage(planned("a")) is Stage.PULL
    assert c.stage(planned("gone")) is Stage.SKIP
    assert c.stage(planned("back", holder=WORKER)) is Stage.HERE  # an evicted request pushed back here
    plan = BatchPlan(batch_id=4, decode_worker_id="decode-1", staging_worker_id=WORKER,
                     buffer=CandidateBuffer.REQUESTS, requests=(planned("a"), planned("gone")))  # fmt: skip
    here = KvLocation(worker_id=WORKER, kind=ServiceKind.PREFILL, ucx_address_key="10.0.0.2:5000")
    published = c.prefetch_done(plan, [True, False], here)
    assert [topic for topic, _ in published] == [topics.decode("decode-1"), topics.BATCHER]
    done = published[0][1]
    assert isinstance(done, PrefetchDone) and done is published[1][1]
    assert (done.batch_id, done.buffer, done.ready, done.failed) == (
        4,
        CandidateBuffer.REQUESTS,
        ("a",),
        ("gone",),
    )
    assert (done.staging_worker_id, done.location) == (WORKER, here)


def test_hand_offs_go_to_a_kvpool_that_serves_and_has_not_stopped() -> None:
    c = core()

    def beat(
        worker_id: str, state: WorkerState, address: bytes, kind: ServiceKind = ServiceKind.KVPOOL
    ) -> None:
        c.on_heartbeat(
            WorkerHeartbeat(kind=kind, worker_id=worker_id, state=state, seq=1, ucx_address=address)
        )

    beat("kvpool-0", WorkerState.STARTING, b"")  # no address yet
    beat("decode-0", WorkerState.READY, b"10.0.0.9:1", ServiceKind.DECODE)
    assert c.pool is None
    beat("kvpool-0", WorkerState.READY, b"10.0.0.1:4000")
    assert c.pool == POOL
    beat("kvpool-1", WorkerState.STOPPED, b"10.0.0.3:4000")
    assert c.pool == POOL


def test_a_hand_off_whose_pool_went_away_loses_the_kv_not_the_request() -> None:
    """RequestLost on the events topic: the gateway re-prefills it; nothing ends it here."""
    [(topic, lost)] = core().lost(prompt("a", 5), "pool unreachable")
    assert topic == topics.EVENTS
    assert isinstance(lost, RequestLost) and (lost.request_id, lost.worker_id) == ("a", WORKER)


def test_without_a_token_limit_those_in_the_engine_do_not_count_against_the_queue() -> None:
    c = core(max_queue=2)
    c.take(prompt("a", 500))
    assert c.has_room([prompt("b", 500)])


def test_a_token_limit_leaves_prompts_to_the_other_workers_once_held_ones_reach_it() -> None:
    c = PrefillCore(WORKER, BLOCK, 100, 8, max_queue=10, intake=Intake(max_backlog_tokens=50))
    c.take(prompt("a", 20))
    assert c.has_room([prompt("b", 29)])  # 49 held
    assert not c.has_room([prompt("b", 30)])  # queued and prefilling together: 50
    c.next_batch(now=0.0)
    assert c.has_room([])


def test_an_idle_intake_worker_reads_only_while_it_holds_no_prompt() -> None:
    c = PrefillCore(WORKER, BLOCK, 100, 8, max_queue=10, intake=Intake(when_idle=True))
    assert c.has_room([])
    assert not c.has_room([prompt("a", 1)])
    c.take(prompt("b", 1))
    assert not c.has_room([])
