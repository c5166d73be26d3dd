"""Messages from the stack to the client's deltas: one gateway's open requests (pure and synchronous).

`TokenBatch` messages (one per producer iteration, many requests each) arrive at least once and may
reorder across producers. Each entry is put in the client's terms by the `MigrationBook` (its request
id, positions shifted past what earlier incarnations released; None for a superseded incarnation), and
the request's `TokenStream` keeps every output position exactly once and in order. What comes out is a
list of (client request id, `TokenDelta`) for the bus backend to put on the requests' queues.
"""

from __future__ import annotations

from alignedserve.bus.messages import (
    BatchPlan,
    FinishReason,
    KvReady,
    Message,
    PrefetchDone,
    PromptScore,
    RequestEvicted,
    RequestFinished,
    TokenBatch,
    TokenEntry,
    TopLogprobs,
)
from alignedserve.bus.token_stream import TokenStreams
from alignedserve.gateway.backend import FINISH_ABORT, GenerationRequest, TokenDelta, TokenLogprob
from alignedserve.gateway.migration import MigrationBook

Routed = tuple[str, TokenDelta]  # (client request id, delta for its queue)
FAILED = (FinishReason.ABORT, FinishReason.ERROR)


class TokenRouter:
    def __init__(self, book: MigrationBook) -> None:
        self.book = book
        self.streams = TokenStreams()

    def open(self, request: GenerationRequest, arrival: float) -> None:
        """Start routing for a new request; ValueError when its id is in flight already."""
        self.book.open(request, arrival)
        self.streams.open(request.request_id)

    def close(self, request_id: str) -> None:
        """The request ended (or its client left): nothing of it is routed or moved any more."""
        self.streams.close(request_id)
        self.book.close(request_id)

    def abort(self, request_id: str) -> Routed:
        """End the request with an abort: the delta that tells its client."""
        self.close(request_id)
        return request_id, TokenDelta(index=0, token_ids=(), finish_reason=FINISH_ABORT)

    def moved(self, request_id: str) -> None:
        """The request moved to a new incarnation: tokens past a gap came from the old one."""
        if request_id in self.streams:
            self.streams[request_id].drop_pending()

    # --- consumed messages (idempotent: TokenStreams drops positions already released) ----------------

    def on_tokens(self, batch: TokenBatch) -> list[Routed]:
        routed = [r for score in batch.prompt_scores for r in self._prompt_score(score)]  # ahead of tokens
        for raw in batch.entries:
            self.book.held(raw.request_id, batch.worker_id, batch.created_at)
            entry = self.book.translate(raw)  # the client's id and positions; None: superseded
            if entry is None or entry.request_id not in self.streams:
                continue
            released = self.streams[entry.request_id].accept(entry)
            self.book.released(entry.request_id, released)
            routed += [(entry.request_id, token_delta(fresh)) for fresh in released]
        return routed

    def failed(self, finished: RequestFinished) -> str | None:
        """The client request a failure report ends (None: a normal end, which arrives as the finish
        reason of the last TokenEntry, or a superseded incarnation's end)."""
        if finished.finish_reason not in FAILED:
            return None
        return self.book.owner(finished.request_id)

    def on_placed(self, message: Message) -> None:
        """Where a request's KV went (batcher topic): who holds it now, for the migration sweep."""
        book = self.book
        if isinstance(message, KvReady):
            book.held(message.request_id, message.location.worker_id, message.created_at)
        elif isinstance(message, BatchPlan):  # planned for this decode worker: its candidate now
            for request_id in message.request_ids:
                book.held(request_id, message.decode_worker_id, message.created_at)
        elif isinstance(message, PrefetchDone):
            for request_id in message.ready:  # staged for this decode worker: its candidate now
                book.held(request_id, message.decode_worker_id, message.created_at)
        elif isinstance(message, RequestEvicted) and message.to is None:  # handed back to the pool
            book.held(message.request_id, message.location.worker_id, message.created_at)

    def _prompt_score(self, score: PromptScore) -> list[Routed]:
        request_id = self.book.owner(score.request_id)  # None: not this gateway's, or superseded
        tracked = None if request_id is None else self.book.get(request_id)
        if request_id is None or tracked is None:
            return []
        return [(request_id, prompt_delta(score, tracked.request.prompt_token_ids))]


def token_delta(entry: TokenEntry) -> TokenDelta:
    logprobs: tuple[TokenLogprob, ...] = ()
    if entry.logprobs is not None:
        logprobs = _logprobs(entry.token_ids, entry.logprobs, entry.top_logprobs or ())
    reason = entry.finish_reason
    finish = None if reason is None else (FINISH_ABORT if reason in FAILED else str(reason))
    return TokenDelta(
        index=entry.first_index,
        token_ids=entry.token_ids,
        logprobs=logprobs,
        finish_reason=finish,
    )


def prompt_delta(score: PromptScore, prompt_token_ids: tuple[int, ...]) -> TokenDelta:
    """A request's prompt logprobs as a delta with no tokens (the assembler takes them once)."""
    scored = _logprobs(prompt_token_ids[1:], score.logprobs, score.top_logprobs)
    return TokenDelta(index=0, token_ids=(), prompt_logprobs=scored)


def _logprobs(
    token_ids: tuple[int, ...], logprobs: tuple[float, ...], tops: tuple[TopLogprobs, ...]
) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token_id,
            logprob,
            tuple(zip(tops[i].token_ids, tops[i].logprobs, strict=True)) if i < len(tops) else (),
        )
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True))
    )
