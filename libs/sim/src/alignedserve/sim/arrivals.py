"""When requests enter the simulated cluster: an arrival process is a strategy the event loop asks.

- `Timestamps`: open loop, each request at its workload arrival time (trace, Poisson, all at once).
- `ClosedLoop(c)`: `c` requests in flight, as the load generator's `--concurrency` runs: the first `c`
  arrive at t = 0, and each completion lets the next request (in workload order) arrive at that instant.

`ArrivalProcess.start(requests)` gives the run's mutable `Arrivals`; the loop merges `next_at()` with
its event queue, takes `pop()` when an arrival comes first, and reports every completion.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from alignedserve.sim.records import SimRequest


class Arrivals(Protocol):
    """One run's arrival state."""

    def next_at(self) -> float | None:
        """Time of the next arrival; None while none is due (closed loop: all slots busy) or left."""
        ...

    def pop(self) -> SimRequest:
        """The next arriving request, its `arrival` set (only after `next_at()` gave a time)."""
        ...

    def completed(self, now: float) -> None:
        """A request completed at `now`."""
        ...

    @property
    def exhausted(self) -> bool:
        """Every request has arrived."""
        ...


class ArrivalProcess(Protocol):
    def start(self, requests: Sequence[SimRequest]) -> Arrivals:
        """Arrivals over `requests` (in workload order)."""
        ...

    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Timestamps:
    """Open loop: every request at its own `arrival` (ties keep workload order)."""

    def start(self, requests: Sequence[SimRequest]) -> Arrivals:
        return _Scheduled(sorted(requests, key=lambda r: r.arrival))

    def describe(self) -> str:
        return "timestamps"


OPEN_LOOP = Timestamps()


class _Scheduled:
    __slots__ = ("_next", "_requests")

    def __init__(self, requests: list[SimRequest]) -> None:
        self._requests = requests
        self._next = 0

    def next_at(self) -> float | None:
        return self._requests[self._next].arrival if self._next < len(self._requests) else None

    def pop(self) -> SimRequest:
        request = self._requests[self._next]
        self._next += 1
        return request

    def completed(self, now: float) -> None:
        return None  # open loop: completions do not drive arrivals

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._requests)


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """`concurrency` requests in flight; each completion lets the next one arrive at once."""

    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def start(self, requests: Sequence[SimRequest]) -> Arrivals:
        return _Closed(list(requests), self.concurrency)

    def describe(self) -> str:
        return f"closed loop, {self.concurrency} in flight"


class _Closed:
    __slots__ = ("_due", "_next", "_requests")

    def __init__(self, requests: list[SimRequest], concurrency: int) -> None:
        self._requests = requests
        self._next = 0
        # release times of free slots not yet taken by a request, oldest first
        self._due: deque[float] = deque([0.0] * min(concurrency, len(requests)))

    def next_at(self) -> float | None:
        return self._due[0] if self._due else None

    def pop(self) -> SimRequest:
        request = self._requests[self._next]
        self._next += 1
        request.arrival = self._due.popleft()
        return request

    def completed(self, now: float) -> None:
        if self._next + len(self._due) < len(self._requests):
            self._due.append(now)

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._requests)
