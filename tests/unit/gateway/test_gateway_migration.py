"""Request migration bookkeeping (pure): incarnations, released tokens, holders, and the bound on moves.

The bus side (RequestLost and silent workers over a real bus) is in
tests/integration/gateway/test_gateway_bus_backend.py; a killed decode worker in tests/e2e.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from alignedserve.bus import topics
from alignedserve.bus.messages import (
    Cancel,
    FinishReason,
    ServiceKind,
    TokenEntry,
    WorkerHeartbeat,
    WorkerState,
)
from alignedserve.bus.token_stream import TokenStream
from alignedserve.core.sampling import SamplingParams
from alignedserve.gateway.backend import BackendStats, GenerationRequest
from alignedserve.gateway.cluster import ClusterView
from alignedserve.gateway.metrics import GatewayMetrics
from alignedserve.gateway.migration import (
    BUS_LOST,
    CANCELLED_ELSEWHERE,
    KV_LOST,
    WORKER_DIED,
    GiveUp,
    Migration,
    MigrationBook,
)
from alignedserve.gateway.moves import MigrationDriver

PROMPT = (5, 6, 7)


def request(rid: str = "cmpl-a", max_tokens: int = 10) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=("x",), ignore_eos=True, logprobs=1)
    return GenerationRequest(rid, "m", PROMPT, params, arrival_time=1.0)


def entry(rid: str, first: int, ids: tuple[int, ...], finish: FinishReason | None = None) -> TokenEntry:
    return TokenEntry(request_id=rid, first_index=first, token_ids=ids, finish_reason=finish)


def release(book: MigrationBook, stream: TokenStream, raw: TokenEntry) -> list[TokenEntry]:
    """What BusBackend does with one entry: translate, keep each position once, record the released."""
    translated = book.translate(raw)
    if translated is None:
        return []
    released = stream.accept(translated)
    book.released(stream.request_id, released)
    return released


def test_a_lost_request_restarts_from_its_prompt_and_released_tokens_and_the_stream_continues() -> None:
    book = MigrationBook(max_migrations=3)
    book.open(request(), arrival=100.0)
    stream = TokenStream("cmpl-a")
    release(book, stream, entry("cmpl-a", 0, (20,)))
    release(book, stream, entry("cmpl-a", 1, (21, 22)))
    release(book, stream, entry("cmpl-a", 4, (24,)))  # ahead of a gap: not released, so not kept
    move = book.lost("cmpl-a", KV_LOST, "decode-1: KV pull failed")
    assert isinstance(move, Migration)
    assert (move.old_incarnation, move.incarnation) == ("cmpl-a", "cmpl-a-m1")
    assert move.prompt_token_ids == (*PROMPT, 20, 21, 22)
    assert (move.max_tokens, move.offset, move.count, move.reason) == (7, 3, 1, KV_LOST)
    assert book.incarnation("cmpl-a") == "cmpl-a-m1" and book.owner("cmpl-a-m1") == "cmpl-a"
    assert book.owner("cmpl-a") is None  # the old incarnation is superseded
    assert book.translate(entry("cmpl-a", 3, (23,))) is None  # a stale copy's tokens are ignored
    assert book.lost("cmpl-a", KV_LOST, "late duplicate") is None
    stream.drop_pending()  # what BusBackend does on a move: position 4 must come from the new incarnation
    # the new incarnation's position i is the client's 3 + i
    out = release(book, stream, entry("cmpl-a-m1", 0, (23,)))
    assert [(e.request_id, e.first_index, e.token_ids) for e in out] == [("cmpl-a", 3, (23,))]
    out = release(book, stream, entry("cmpl-a-m1", 1, (24, 25, 26, 27, 28, 29), FinishReason.LENGTH))
    assert out[-1].finish_reason is FinishReason.LENGTH and stream.next_index == 10
    assert book.migrate("cmpl-a", WORKER_DIED, "finished already") is None


def test_the_second_move_counts_from_the_original_prompt_and_offset() -> None:
    book = MigrationBook(max_migrations=3)
    book.open(request(max_tokens=8), arrival=100.0)
    stream = TokenStream("cmpl-a")
    release(book, stream, entry("cmpl-a", 0, (20, 21)))
    first = book.migrate("cmpl-a", WORKER_DIED, "decode-1 stopped beating")
    assert isinstance(first, Migration)
    release(book, stream, entry("cmpl-a-m1", 0, (22,)))
    release(book, stream, entry("cmpl-a-m1", 1, (23,)))
    second = book.lost("cmpl-a-m1", KV_LOST, "import failed")
    assert isinstance(second, Migration)
    assert second.incarnation == "cmpl-a-m2" and second.old_incarnation == "cmpl-a-m1"
    assert second.prompt_token_ids == (*PROMPT, 20, 21, 22, 23)
    assert (second.max_tokens, second.offset, second.count) == (4, 4, 2)
    out = release(book, stream, entry("cmpl-a-m2", 0, (24,)))
    assert out[0].first_index == 4


def test_moves_are_bounded_then_the_request_gives_up() -> None:
    book = MigrationBook(max_migrations=2)
    book.open(request(), arrival=100.0)
    assert isinstance(book.lost("cmpl-a", KV_LOST, "1"), Migration)
    assert isinstance(book.lost("cmpl-a-m1", KV_LOST, "2"), Migration)
    given_up = book.lost("cmpl-a-m2", KV_LOST, "3")
    assert isinstance(given_up, GiveUp)
    assert (given_up.request_id, given_up.incarnation, given_up.count) == ("cmpl-a", "cmpl-a-m2", 2)
    never = MigrationBook(max_migrations=0)
    never.open(request(), arrival=100.0)
    assert isinstance(never.lost("cmpl-a", KV_LOST, "no moves allowed"), GiveUp)


def test_the_holder_is_the_latest_by_created_at_and_resets_on_a_move() -> None:
    book = MigrationBook()
    book.open(request("cmpl-a"), arrival=100.0)
    book.open(request("cmpl-b"), arrival=100.0)
    book.held("cmpl-a", "prefill-0", created_at=10.0)
    book.held("cmpl-a", "decode-1", created_at=12.0)
    book.held("cmpl-a", "kvpool-0", created_at=11.0)  # older news, delivered late
    book.held("cmpl-other-gateway", "decode-1", created_at=13.0)  # not ours: ignored
    assert book.held_by({"decode-1"}) == ["cmpl-a"] and book.unheld() == ["cmpl-b"]
    move = book.migrate("cmpl-a", WORKER_DIED, "decode-1 stopped beating")
    assert isinstance(move, Migration)
    assert book.held_by({"decode-1"}) == [] and book.unheld() == ["cmpl-a", "cmpl-b"]
    book.held("cmpl-a", "decode-1", created_at=20.0)  # the old incarnation's news changes nothing
    assert book.held_by({"decode-1"}) == []
    book.held("cmpl-a-m1", "decode-0", created_at=1.0)  # the new incarnation's first holder, any time
    assert book.held_by({"decode-0"}) == ["cmpl-a"]


def test_incarnation_ids_keep_to_the_client_id_alphabet_and_never_collide() -> None:
    book = MigrationBook()
    book.open(request("cmpl-a"), arrival=100.0)
    book.open(request("cmpl-a-m1"), arrival=100.0)  # a client chose the id our first move would take
    move = book.migrate("cmpl-a", KV_LOST, "x")
    assert isinstance(move, Migration) and move.incarnation == "cmpl-a-m1.1"
    with pytest.raises(ValueError, match="in flight"):
        book.open(request("cmpl-a-m1.1"), arrival=100.0)
    book.close("cmpl-a")
    assert book.owner("cmpl-a-m1.1") is None and "cmpl-a" not in book and len(book) == 1


def test_dead_workers_are_silent_ones_not_gracefully_stopped_ones() -> None:
    cluster = ClusterView()

    def beat(worker_id: str, kind: ServiceKind, state: WorkerState, now: float) -> None:
        cluster.heartbeat(WorkerHeartbeat(kind=kind, worker_id=worker_id, state=state, seq=1), now)

    beat("decode-0", ServiceKind.DECODE, WorkerState.READY, now=0.0)
    beat("decode-1", ServiceKind.DECODE, WorkerState.READY, now=0.0)
    beat("decode-2", ServiceKind.DECODE, WorkerState.STOPPED, now=0.0)  # drained: handed its work back
    beat("prefill-0", ServiceKind.PREFILL, WorkerState.DRAINING, now=0.0)
    beat("decode-0", ServiceKind.DECODE, WorkerState.READY, now=9.0)
    assert cluster.dead(now=10.0, timeout_s=5.0) == {
        "decode-1": ServiceKind.DECODE,
        "prefill-0": ServiceKind.PREFILL,
    }
    assert cluster.dead(now=4.0, timeout_s=5.0) == {}


def test_migrations_are_counted_by_reason_on_metrics() -> None:
    counts = {KV_LOST: 2, WORKER_DIED: 1}
    metrics = GatewayMetrics("m", BackendStats, migrations=lambda: counts)
    text = generate_latest(metrics.registry).decode()
    assert 'alignedserve:request_migrations_total{model_name="m",reason="kv_lost"} 2.0' in text
    assert 'alignedserve:request_migrations_total{model_name="m",reason="worker_died"} 1.0' in text
    assert "request_migrations" not in generate_latest(GatewayMetrics("m", BackendStats).registry).decode()


def test_a_cancel_of_a_current_incarnation_from_elsewhere_moves_it_and_an_own_cancel_does_not() -> None:
    book = MigrationBook(max_migrations=3)
    for rid in ("cmpl-live", "cmpl-left"):
        book.open(request(rid), arrival=100.0)
    driver = MigrationDriver(book, "gw")
    book.close("cmpl-left")  # its client left: the gateway closes it, then cancels it
    assert driver.cancelled(Cancel(request_id="cmpl-left")) == []
    [move] = driver.cancelled(Cancel(request_id="cmpl-live", reason="gateway gw silent"))
    assert isinstance(move.decision, Migration) and move.decision.reason == CANCELLED_ELSEWHERE
    new_id = move.decision.incarnation
    assert driver.cancelled(Cancel(request_id="cmpl-live")) == []  # the old id, cancelled by the move
    assert book.incarnation("cmpl-live") == new_id


def test_a_broker_loss_moves_every_unfinished_request_held_or_not() -> None:
    book = MigrationBook(max_migrations=3)
    for rid in ("cmpl-held", "cmpl-queued", "cmpl-done"):
        book.open(request(rid, max_tokens=3), arrival=100.0)
    book.held("cmpl-held", "decode-0", created_at=1.0)
    stream = TokenStream("cmpl-done")
    release(book, stream, entry("cmpl-done", 0, (20, 21, 22), FinishReason.LENGTH))
    driver = MigrationDriver(book, "gw")
    moves = driver.bus_lost("Redis lost alignedserve.prefill")
    assert sorted(m.request_id for m in moves) == ["cmpl-held", "cmpl-queued"]
    for move in moves:
        assert isinstance(move.decision, Migration) and move.decision.reason == BUS_LOST
        (cancel_topic, cancel), (prefill_topic, _) = move.publish
        assert isinstance(cancel, Cancel) and cancel.request_id == move.request_id
        assert (cancel_topic, prefill_topic) == (topics.EVENTS, topics.PREFILL)
    assert driver.counts[BUS_LOST] == 2
