"""When requests move, and the messages that move them (pure: the bus backend publishes what comes out).

The `MigrationBook` (migration.py) decides one request at a time; this is what asks it and when:
- a worker reports a request's KV lost (`RequestLost`): that request moves;
- a worker restarted (a beat of a newer process under its id): what it held is gone, so it all moves;
- the periodic sweep: what silent workers hold moves; and when a prefill worker newly goes silent, so do
  the requests no worker holds yet (queued or being prefilled: one of them may have been its), once per
  death;
- the broker lost its data (a subscription found its streams or topics gone): any message of any request
  may have gone with it, so every unfinished request moves;
- another service cancelled a current incarnation (a decode worker took this gateway for gone: its
  heartbeats were held up past the worker's timeout): the request is alive, so it moves.
Each decision becomes a `Move`: the Cancel of the old incarnation (frees its blocks everywhere, stops a
stale copy) and, unless the book gave up, the new incarnation's `PrefillRequest`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from alignedserve.bus import topics
from alignedserve.bus.messages import Cancel, Message, PrefillRequest, RequestLost, ServiceKind
from alignedserve.gateway.migration import (
    BUS_LOST,
    CANCELLED_ELSEWHERE,
    KV_LOST,
    PREFILL_DIED,
    WORKER_DIED,
    GiveUp,
    Migration,
    MigrationBook,
)
from alignedserve.service.sampling import to_spec

Publish = tuple[str, Message]  # (topic, message), published in order


@dataclass(frozen=True)
class Move:
    decision: Migration | GiveUp
    publish: tuple[Publish, ...]

    @property
    def request_id(self) -> str:
        return self.decision.request_id


class MigrationDriver:
    def __init__(self, book: MigrationBook, gateway_id: str) -> None:
        self.book = book
        self.gateway_id = gateway_id
        self.counts: collections.Counter[str] = collections.Counter()  # reason -> migrations
        self._dead_prefill: set[str] = set()  # silent prefill workers whose requests were moved already

    def lost(self, message: RequestLost) -> list[Move]:
        decision = self.book.lost(message.request_id, KV_LOST, f"{message.worker_id}: {message.reason}")
        return self._moves([decision])

    def cancelled(self, message: Cancel) -> list[Move]:
        """A Cancel of a current incarnation is never this gateway's own (it closes a request, or moves
        it, before it cancels the old id): another service took this gateway for gone. It moves."""
        return self._moves([self.book.lost(message.request_id, CANCELLED_ELSEWHERE, message.reason)])

    def bus_lost(self, detail: str) -> list[Move]:
        """The broker forgot what it held: every unfinished request starts again from what it released."""
        return self._moves([self.book.migrate(rid, BUS_LOST, detail) for rid in self.book.unfinished()])

    def restarted(self, worker_id: str) -> list[Move]:
        """Back before it was missed: what its old process held is gone all the same."""
        return self._held_by({worker_id}, "restarted")

    def sweep(self, silent: Mapping[str, ServiceKind]) -> list[Move]:
        """Requests held by a silent worker; and the unheld ones when a prefill worker newly fell silent."""
        moves = self._held_by(set(silent), "stopped beating")
        dead_prefill = {w for w, kind in silent.items() if kind is ServiceKind.PREFILL}
        newly = sorted(dead_prefill - self._dead_prefill)
        self._dead_prefill = dead_prefill  # one that beats again and dies again counts again
        if newly:
            detail = f"{', '.join(newly)} stopped beating before it produced a token"
            moves += self._moves(
                [self.book.migrate(request_id, PREFILL_DIED, detail) for request_id in self.book.unheld()]
            )
        return moves

    def _held_by(self, workers: Collection[str], what: str) -> list[Move]:
        decisions = []
        for request_id in self.book.held_by(workers):
            tracked = self.book.get(request_id)
            holder = tracked.holder if tracked is not None else "?"
            decisions.append(self.book.migrate(request_id, WORKER_DIED, f"{holder} {what}"))
        return self._moves(decisions)

    def _moves(self, decisions: list[Migration | GiveUp | None]) -> list[Move]:
        return [self._move(d) for d in decisions if d is not None]

    def _move(self, decision: Migration | GiveUp) -> Move:
        old = decision.old_incarnation if isinstance(decision, Migration) else decision.incarnation
        cancel = Cancel(request_id=old, reason=f"request lost ({decision.reason})")
        if isinstance(decision, GiveUp):
            return Move(decision, ((topics.EVENTS, cancel),))
        self.counts[decision.reason] += 1
        return Move(decision, ((topics.EVENTS, cancel), (topics.PREFILL, self._incarnation(decision))))

    def _incarnation(self, migration: Migration) -> PrefillRequest:
        tracked = self.book.get(migration.request_id)
        assert tracked is not None, "the book returns migrations of tracked requests only"
        # Prompt scores come with the first token: once a token was released they were delivered, and
        # the new incarnation's prompt (original + released tokens) is not the one to score.
        scoring = None if tracked.released else tracked.request.sampling.prompt_logprobs
        sampling = dataclasses.replace(
            tracked.request.sampling, max_tokens=migration.max_tokens, prompt_logprobs=scoring
        )
        return PrefillRequest(
            request_id=migration.incarnation,
            model=tracked.request.model,
            prompt_token_ids=migration.prompt_token_ids,
            sampling=to_spec(sampling),
            arrival=tracked.arrival,  # keeps its age in the pool
            gateway_id=self.gateway_id,
            client_request_id=tracked.request.client_request_id,
        )
