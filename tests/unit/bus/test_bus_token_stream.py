"""Gateway token streams: each output position released once, in order, whatever arrives twice or early."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alignedserve.bus.messages import FinishReason, TokenBatch, TokenEntry
from alignedserve.bus.token_stream import TokenStream, TokenStreams


def entry(first: int, tokens: list[int], finish: FinishReason | None = None) -> TokenEntry:
    return TokenEntry(
        request_id="r",
        first_index=first,
        token_ids=tuple(tokens),
        finish_reason=finish,
        logprobs=tuple(-float(t) for t in tokens),
    )


def released_tokens(entries: list[TokenEntry]) -> list[int]:
    return [t for e in entries for t in e.token_ids]


def test_in_order_entries_pass_through() -> None:
    s = TokenStream("r")
    assert released_tokens(s.accept(entry(0, [10]))) == [10]
    assert released_tokens(s.accept(entry(1, [11, 12]))) == [11, 12]
    assert s.next_index == 3 and not s.finished


def test_duplicate_and_overlap_are_trimmed_with_their_logprobs() -> None:
    s = TokenStream("r")
    s.accept(entry(0, [10, 11]))
    assert s.accept(entry(0, [10, 11])) == []
    (fresh,) = s.accept(entry(1, [11, 12, 13]))
    assert fresh.first_index == 2 and fresh.token_ids == (12, 13) and fresh.logprobs == (-12.0, -13.0)


def test_early_entry_waits_for_the_gap() -> None:
    s = TokenStream("r")
    assert s.accept(entry(2, [12], FinishReason.STOP)) == []
    assert released_tokens(s.accept(entry(0, [10]))) == [10]
    out = s.accept(entry(1, [11]))
    assert released_tokens(out) == [11, 12]
    assert s.finish_reason is FinishReason.STOP


def test_nothing_after_finish() -> None:
    s = TokenStream("r")
    s.accept(entry(0, [10], FinishReason.LENGTH))
    assert s.accept(entry(1, [11])) == [] and s.accept(entry(0, [10], FinishReason.LENGTH)) == []


def test_a_finish_with_no_tokens_is_released() -> None:
    s = TokenStream("r")
    s.accept(entry(0, [10]))
    (done,) = s.accept(entry(1, [], FinishReason.ABORT))
    assert done.token_ids == () and s.finish_reason is FinishReason.ABORT


def test_wrong_request_or_negative_index_is_an_error() -> None:
    s = TokenStream("r")
    with pytest.raises(ValueError, match="given to the stream"):
        s.accept(TokenEntry(request_id="x", first_index=0, token_ids=(1,)))
    with pytest.raises(ValueError, match="negative first_index"):
        s.accept(entry(-1, [1]))


def test_streams_route_batches_and_ignore_unknown_requests() -> None:
    streams = TokenStreams()
    streams.open("a")
    streams.open("b")
    with pytest.raises(ValueError, match="already open"):
        streams.open("a")
    batch = TokenBatch(
        worker_id="d",
        iteration=0,
        entries=(
            TokenEntry(request_id="a", first_index=0, token_ids=(1,)),
            TokenEntry(request_id="zzz", first_index=0, token_ids=(9,)),
            TokenEntry(request_id="b", first_index=0, token_ids=(2,)),
        ),
    )
    out = streams.accept(batch)
    assert {rid: released_tokens(v) for rid, v in out.items()} == {"a": [1], "b": [2]}
    assert streams.accept(batch) == {}
    streams.close("a")
    assert "a" not in streams and len(streams) == 1


@settings(max_examples=100, deadline=None)
@given(
    length=st.integers(min_value=1, max_value=40),
    cuts=st.lists(st.integers(min_value=1, max_value=39), max_size=10),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_any_redelivery_order_releases_the_exact_stream(length: int, cuts: list[int], seed: int) -> None:
    """Split a stream into chunks, deliver each 1-3 times, shuffled, plus overlapping replays."""
    tokens = list(range(100, 100 + length))
    bounds = sorted({0, length, *(c for c in cuts if c < length)})
    chunks = [
        entry(a, tokens[a:b], FinishReason.STOP if b == length else None)
        for a, b in itertools.pairwise(bounds)
    ]
    rng = random.Random(seed)
    deliveries = [c for c in chunks for _ in range(rng.randint(1, 3))]
    replay_from = rng.randrange(length)
    deliveries.append(entry(replay_from, tokens[replay_from:], FinishReason.STOP))  # a producer replay
    rng.shuffle(deliveries)
    s = TokenStream("r")
    out = [e for d in deliveries for e in s.accept(d)]
    assert released_tokens(out) == tokens
    assert [t for e in out for t in (e.logprobs or ())] == [-float(t) for t in tokens]
    assert s.finish_reason is FinishReason.STOP
