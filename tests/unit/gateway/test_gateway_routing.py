"""The bus backend's pure parts: token routing into per-request deltas, the moves a lost or silent worker
causes (and the messages that carry them out), and load over the live workers only."""

from __future__ import annotations

from alignedserve.bus import topics
from alignedserve.bus.messages import (
    Cancel,
    CandidateBuffer,
    DecodeStatus,
    FinishReason,
    PrefetchDone,
    PrefillRequest,
    PromptScore,
    RequestFinished,
    RequestLost,
    ServiceKind,
    TokenBatch,
    TokenEntry,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.core.sampling import SamplingParams
from alignedserve.gateway.backend import FINISH_ABORT, GenerationRequest, TokenDelta
from alignedserve.gateway.cluster import ClusterView
from alignedserve.gateway.migration import (
    KV_LOST,
    PREFILL_DIED,
    WORKER_DIED,
    GiveUp,
    Migration,
    MigrationBook,
)
from alignedserve.gateway.moves import MigrationDriver
from alignedserve.gateway.routing import TokenRouter

PROMPT = (5, 6, 7)


def request(rid: str, max_tokens: int = 10) -> GenerationRequest:
    return GenerationRequest(rid, "m", PROMPT, SamplingParams(max_tokens=max_tokens), arrival_time=1.0)


def batch(worker_id: str, *entries: TokenEntry, created_at: float = 1.0) -> TokenBatch:
    return TokenBatch(worker_id=worker_id, iteration=1, entries=entries, created_at=created_at)


def entry(rid: str, first: int, ids: tuple[int, ...], finish: FinishReason | None = None) -> TokenEntry:
    return TokenEntry(request_id=rid, first_index=first, token_ids=ids, finish_reason=finish)


def router_with(*rids: str, max_migrations: int = 3) -> TokenRouter:
    router = TokenRouter(MigrationBook(max_migrations))
    for rid in rids:
        router.open(request(rid), arrival=100.0)
    return router


def test_tokens_reach_their_request_once_and_in_order() -> None:
    router = router_with("a", "b")
    assert router.on_tokens(batch("d0", entry("a", 1, (21,)), entry("x", 0, (1,)))) == []  # gap; not ours
    routed = router.on_tokens(batch("d0", entry("b", 0, (30,)), entry("a", 0, (20,)), entry("a", 0, (20,))))
    assert [(rid, d.index, d.token_ids) for rid, d in routed] == [
        ("b", 0, (30,)),
        ("a", 0, (20,)),
        ("a", 1, (21,)),
    ]
    (last,) = router.on_tokens(batch("d0", entry("a", 2, (22,), FinishReason.LENGTH)))
    assert last[1].finish_reason == "length"
    router.close("a")
    assert router.on_tokens(batch("d0", entry("a", 3, (23,)))) == []


def test_prompt_scores_go_first_and_a_failure_names_its_request() -> None:
    router = router_with("a")
    score = PromptScore(request_id="a", logprobs=(-1.0, -2.0), top_logprobs=())
    routed = router.on_tokens(TokenBatch(worker_id="p0", iteration=0, entries=(entry("a", 0, (20,)),),
                                         prompt_scores=(score,)))  # fmt: skip
    assert [d.prompt_logprobs is not None for _, d in routed] == [True, False]
    failed = RequestFinished(request_id="a", worker_id="d0", finish_reason=FinishReason.ERROR,
                             prompt_tokens=3, completion_tokens=0)  # fmt: skip
    assert router.failed(failed) == "a"
    assert router.abort("a") == ("a", TokenDelta(index=0, token_ids=(), finish_reason=FINISH_ABORT))
    assert router.failed(failed) is None  # ended: nothing to fail any more


def test_a_lost_request_moves_with_a_cancel_and_a_new_prefill_request() -> None:
    router = router_with("a")
    driver = MigrationDriver(router.book, "gw-1")
    router.on_tokens(batch("p0", entry("a", 0, (20,))))
    (move,) = driver.lost(RequestLost(request_id="a", worker_id="d0", reason="pull failed"))
    assert isinstance(move.decision, Migration) and move.request_id == "a"
    (cancel_topic, cancel), (prefill_topic, again) = move.publish
    assert cancel_topic == topics.EVENTS and isinstance(cancel, Cancel) and cancel.request_id == "a"
    assert prefill_topic == topics.PREFILL and isinstance(again, PrefillRequest)
    assert (again.request_id, again.prompt_token_ids, again.sampling.max_tokens) == ("a-m1", (*PROMPT, 20), 9)
    assert (again.arrival, again.gateway_id) == (100.0, "gw-1")
    assert driver.lost(RequestLost(request_id="a", worker_id="d0", reason="again")) == []  # superseded
    assert driver.counts == {KV_LOST: 1}


def test_the_sweep_moves_what_silent_workers_hold_and_the_unheld_once_per_prefill_death() -> None:
    router = router_with("a", "b", "c")
    driver = MigrationDriver(router.book, "gw-1")
    router.on_tokens(batch("d1", entry("a", 0, (20,))))
    router.on_placed(PrefetchDone(batch_id=1, staging_worker_id="p0", decode_worker_id="d2",
                                  buffer=CandidateBuffer.BATCH, ready=("b",)))  # fmt: skip
    moves = driver.sweep({"d1": ServiceKind.DECODE})
    assert [(m.request_id, m.decision.reason) for m in moves] == [("a", WORKER_DIED)]
    moves = driver.sweep({"p1": ServiceKind.PREFILL})  # c was not held by anyone: it may have been p1's
    assert [(m.request_id, m.decision.reason) for m in moves] == [("a", PREFILL_DIED), ("c", PREFILL_DIED)]
    assert driver.sweep({"p1": ServiceKind.PREFILL}) == []  # the same death counts once
    assert driver.counts == {WORKER_DIED: 1, PREFILL_DIED: 2}


def test_a_restarted_worker_s_requests_move_and_a_request_out_of_moves_gives_up() -> None:
    router = router_with("a", max_migrations=0)
    driver = MigrationDriver(router.book, "gw-1")
    router.on_tokens(batch("d1", entry("a", 0, (20,))))
    (move,) = driver.restarted("d1")
    assert isinstance(move.decision, GiveUp)
    assert [type(m) for _, m in move.publish] == [Cancel]  # no new incarnation
    assert driver.counts == {}


def test_load_counts_live_workers_only() -> None:
    cluster = ClusterView()

    def beat(kind: ServiceKind, worker_id: str, state: WorkerState = WorkerState.READY, **kv: int) -> None:
        cluster.heartbeat(WorkerHeartbeat(kind=kind, worker_id=worker_id, state=state, seq=1, **kv), now=0.0)

    beat(ServiceKind.PREFILL, "p0")
    beat(ServiceKind.DECODE, "d0")
    beat(ServiceKind.DECODE, "d1", WorkerState.DRAINING)
    beat(ServiceKind.KVPOOL, "k0", kv_used_bytes=30, kv_capacity_bytes=100)
    beat(ServiceKind.KVPOOL, "k1", WorkerState.STOPPED, kv_used_bytes=90, kv_capacity_bytes=100)
    for worker_id, free in (("d0", 25), ("d1", 0)):
        cluster.status(DecodeStatus(worker_id=worker_id, seq=1, free_blocks=free, total_blocks=100, running=3,
                                    prefix_lo=0, prefix_hi=0, idle=False))  # fmt: skip
    stats = cluster.stats(now=1.0, timeout_s=5.0, in_flight=5)
    assert (stats.num_requests_running, stats.num_requests_waiting) == (3, 2)
    assert (stats.decode_kv_usage, stats.kv_pool_usage) == (0.75, 0.3)
    assert cluster.serving(now=1.0, timeout_s=5.0) and not cluster.serving(now=6.0, timeout_s=5.0)
    assert cluster.stats(now=6.0, timeout_s=5.0, in_flight=5).num_requests_waiting == 5  # all silent
