"""Request migration: a request whose KV is lost is re-prefilled, never lost (pure bookkeeping).

The gateway is the one place that still has everything a request needs after any worker is gone: the
original prompt and sampling, and the tokens it has released to the client. So when a decode worker
reports the KV lost (`RequestLost`), or the worker holding the request stops beating, the request starts
again under a new *incarnation* id: prompt = original prompt + tokens released so far, max_tokens = what
is left. The new incarnation's output position i is the client's position `offset + i` (offset = tokens
released at the move), so the client sees one continuous stream; `TokenStream` still keeps each
position once. The old incarnation is cancelled everywhere (frees its blocks, stops a stale copy), and
its late messages are ignored here because they no longer name the current incarnation.

Who holds a request ("holder"): the last worker a message placed it on, by the message's `created_at`:
the producer of its latest `TokenBatch`, the kvpool once `KvReady` says its KV is there, the decode
worker a `PrefetchDone` staged it for. Pure and synchronous: the bus backend publishes what comes out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field

from alignedserve.bus.messages import TokenEntry
from alignedserve.gateway.backend import GenerationRequest

# Why a request moved (the metric's label; the details go to the log).
KV_LOST = "kv_lost"  # a worker reported its KV lost (RequestLost)
WORKER_DIED = "worker_died"  # the worker holding it stopped beating without a graceful STOPPED
PREFILL_DIED = "prefill_died"  # a prefill worker died while the request had no token and no holder yet
BUS_LOST = "bus_lost"  # the broker lost its data (restarted without storage, flushed): messages are gone
# another service cancelled a current incarnation: a decode worker took this gateway for gone (its
# heartbeats held up past the worker's timeout); the request is alive, so it moves
CANCELLED_ELSEWHERE = "cancelled_elsewhere"


@dataclass(frozen=True)
class Migration:
    """Start the request again: cancel `old_incarnation`, prefill `prompt_token_ids` as `incarnation`."""

    request_id: str  # the client's request
    old_incarnation: str
    incarnation: str
    prompt_token_ids: tuple[int, ...]  # original prompt + tokens released so far
    max_tokens: int  # original max_tokens - tokens released so far
    offset: int  # tokens released so far: the new incarnation's position 0 is the client's `offset`
    count: int  # migrations of this request, this one included
    reason: str  # KV_LOST, WORKER_DIED, PREFILL_DIED, BUS_LOST or CANCELLED_ELSEWHERE
    detail: str


@dataclass(frozen=True)
class GiveUp:
    """The request moved `count` times already: it ends with an error (its incarnation is cancelled)."""

    request_id: str
    incarnation: str
    count: int
    reason: str
    detail: str


@dataclass
class Tracked:
    """One in-flight request as the gateway sees it across incarnations."""

    request: GenerationRequest
    arrival: float  # wall clock when the gateway accepted it (kept: the pool ages it from there)
    incarnation: str
    offset: int = 0
    released: list[int] = field(default_factory=list)  # token ids released to the client, in order
    holder: str | None = None  # worker holding the current incarnation (None: not known yet)
    holder_at: float = float("-inf")  # created_at of the message that named the holder
    migrations: int = 0
    finished: bool = False  # its last token was released: nothing left to move


class MigrationBook:
    """Every in-flight request of one gateway, keyed by the client's id and by its current incarnation."""

    def __init__(self, max_migrations: int = 3) -> None:
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        self.max_migrations = max_migrations
        self._tracked: dict[str, Tracked] = {}  # client request id -> its state
        self._owner: dict[str, str] = {}  # current incarnation id -> client request id

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tracked

    def __len__(self) -> int:
        return len(self._tracked)

    def open(self, request: GenerationRequest, arrival: float) -> None:
        """Track a new request; its first incarnation is its own id."""
        rid = request.request_id
        if rid in self._tracked or rid in self._owner:
            raise ValueError(f"request id {rid!r} is in flight already")
        self._tracked[rid] = Tracked(request, arrival, incarnation=rid)
        self._owner[rid] = rid

    def close(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self._owner.pop(tracked.incarnation, None)

    def get(self, request_id: str) -> Tracked | None:
        return self._tracked.get(request_id)

    def incarnation(self, request_id: str) -> str | None:
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.incarnation

    def owner(self, incarnation: str) -> str | None:
        """The client request whose *current* incarnation this is (None: unknown or superseded)."""
        return self._owner.get(incarnation)

    # --- messages from the stack ------------------------------------------------------------------------

    def translate(self, entry: TokenEntry) -> TokenEntry | None:
        """The entry in the client's terms (its request id, positions shifted by the offset); None when
        it belongs to no current incarnation (a superseded one, or another gateway's request)."""
        rid = self._owner.get(entry.request_id)
        if rid is None:
            return None
        offset = self._tracked[rid].offset
        if rid == entry.request_id and offset == 0:
            return entry
        return dataclasses.replace(entry, request_id=rid, first_index=entry.first_index + offset)

    def released(self, request_id: str, entries: Collection[TokenEntry]) -> None:
        """Record what the client's stream released (entries trimmed to new positions, in order)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        for entry in entries:
            tracked.released.extend(entry.token_ids)
            tracked.finished = tracked.finished or entry.finish_reason is not None

    def held(self, incarnation: str, worker_id: str, created_at: float) -> None:
        """`worker_id` holds the incarnation as of `created_at`; older news changes nothing."""
        rid = self._owner.get(incarnation)
        if rid is None or not worker_id:
            return
        tracked = self._tracked[rid]
        if created_at >= tracked.holder_at:
            tracked.holder, tracked.holder_at = worker_id, created_at

    # --- losses -----------------------------------------------------------------------------------------

    def held_by(self, workers: Collection[str]) -> list[str]:
        """Unfinished requests whose holder is one of `workers`."""
        return [
            rid
            for rid, t in self._tracked.items()
            if not t.finished and t.holder is not None and t.holder in workers
        ]

    def unheld(self) -> list[str]:
        """Unfinished requests no worker has named itself the holder of (queued or being prefilled)."""
        return [rid for rid, t in self._tracked.items() if not t.finished and t.holder is None]

    def unfinished(self) -> list[str]:
        """Every request still waiting for tokens, held or not."""
        return [rid for rid, t in self._tracked.items() if not t.finished]

    def lost(self, incarnation: str, reason: str, detail: str) -> Migration | GiveUp | None:
        """A worker reports the incarnation's KV gone; None when it is not a current incarnation."""
        rid = self._owner.get(incarnation)
        return None if rid is None else self.migrate(rid, reason, detail)

    def migrate(self, request_id: str, reason: str, detail: str) -> Migration | GiveUp | None:
        """Move the request to a new incarnation (or give up after `max_migrations`); None: nothing to
        move (unknown or already finished)."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.finished:
            return None
        old = tracked.incarnation
        remaining = tracked.request.sampling.max_tokens - len(tracked.released)
        if tracked.migrations >= self.max_migrations or remaining < 1:
            return GiveUp(request_id, old, tracked.migrations, reason, detail)
        tracked.migrations += 1
        new = self._new_incarnation(request_id, tracked.migrations)
        del self._owner[old]
        self._owner[new] = request_id
        tracked.incarnation = new
        tracked.offset = len(tracked.released)
        tracked.holder, tracked.holder_at = None, float("-inf")
        return Migration(
            request_id=request_id,
            old_incarnation=old,
            incarnation=new,
            prompt_token_ids=(*tracked.request.prompt_token_ids, *tracked.released),
            max_tokens=remaining,
            offset=tracked.offset,
            count=tracked.migrations,
            reason=reason,
            detail=detail,
        )

    def _new_incarnation(self, request_id: str, count: int) -> str:
        """`<id>-m<n>`: the characters client ids may use; skip an id some other request has."""
        candidate, extra = f"{request_id}-m{count}", 0
        while candidate in self._owner or candidate in self._tracked:
            extra += 1
            candidate = f"{request_id}-m{count}.{extra}"
        return candidate
