"""Worker liveness from heartbeats: who is up, who went silent, who restarted (pure: callers pass `now`).

Every service beats on the events topic (`alignedserve.bus.messages.WorkerHeartbeat`): its kind, id and
state, a `seq` that counts per process and the wall-clock `started_at` of its process. A reader that
must know which workers it can count on keeps one `Liveness` and feeds it every beat with the time it
was heard (any clock, as long as it is the one `live` and `silent` are asked with: a monotonic one).

- A beat of an older process under the same id (lower `started_at`), or a beat of the known process
  that a newer one overtook (lower `seq`), is ignored: delivery is at least once and may reorder. A
  STARTING beat is never late: a process restarted within the clock's resolution (or one that sends no
  `started_at`) starts counting `seq` again.
- A worker is *live* while its last beat said READY and is at most `timeout_s` old.
- It is *silent* once its last beat is older than `timeout_s` and did not say STOPPED: killed, hung or
  cut off. A graceful stop (drain, then STOPPED) hands its work back and is no death.

Generic over the kind (the bus's `ServiceKind`); states are compared by value with `WorkerState`'s
strings, so this module needs no wire type.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

# The values of `alignedserve.bus.messages.WorkerState` (a StrEnum: its members compare equal to these).
STARTING = "starting"
READY = "ready"
DRAINING = "draining"
STOPPED = "stopped"

K = TypeVar("K", bound=Hashable)
K_co = TypeVar("K_co", bound=Hashable, covariant=True)


class Beat(Protocol[K_co]):
    """What a heartbeat says (`WorkerHeartbeat` is one)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def kind(self) -> K_co: ...
    @property
    def state(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def started_at(self) -> float: ...


class Heard(enum.Enum):
    """What one beat told about its worker."""

    FIRST = "first"  # an id not known (or forgotten) before
    AGAIN = "again"  # the known process, beating on
    RESTARTED = "restarted"  # a newer process under a known id: what the old one held is gone
    LATE = "late"  # a beat of an older process, or one of the known process overtaken: ignored


@dataclass(frozen=True, slots=True)
class Seen(Generic[K]):
    """A worker's last beat that counted, and when it was heard."""

    kind: K
    state: str
    seq: int
    started_at: float
    heard_at: float


class Liveness(Generic[K]):
    """Every worker heard of, by id (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._workers: dict[str, Seen[K]] = {}

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> Seen[K] | None:
        return self._workers.get(worker_id)

    def heard(self, beat: Beat[K], now: float) -> Heard:
        """Record `beat`, heard at `now`, unless it is late."""
        known = self._workers.get(beat.worker_id)
        if known is not None and _late(beat, known):
            return Heard.LATE
        self._workers[beat.worker_id] = Seen(beat.kind, beat.state, beat.seq, beat.started_at, now)
        if known is None:
            return Heard.FIRST
        return Heard.RESTARTED if beat.started_at > known.started_at else Heard.AGAIN

    def forget(self, worker_id: str) -> None:
        """Stop tracking the worker (its next beat is FIRST again)."""
        self._workers.pop(worker_id, None)

    def live(self, kind: K, now: float, timeout_s: float) -> list[str]:
        """Workers of `kind` whose last beat said READY and is at most `timeout_s` old, in the order
        they were first heard of."""
        return [
            worker_id
            for worker_id, seen in self._workers.items()
            if seen.kind == kind and seen.state == READY and now - seen.heard_at <= timeout_s
        ]

    def silent(self, now: float, timeout_s: float, kind: K | None = None) -> dict[str, K]:
        """Workers (of `kind`, or of any) silent for longer than `timeout_s` whose last beat was not
        STOPPED: worker id -> kind."""
        return {
            worker_id: seen.kind
            for worker_id, seen in self._workers.items()
            if (kind is None or seen.kind == kind)
            and seen.state != STOPPED
            and now - seen.heard_at > timeout_s
        }


def _late(beat: Beat[K], known: Seen[K]) -> bool:
    if beat.started_at != known.started_at:
        return beat.started_at < known.started_at
    return beat.seq < known.seq and beat.state != STARTING
