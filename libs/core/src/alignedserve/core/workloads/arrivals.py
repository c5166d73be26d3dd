"""When requests are sent: an arrival process is a strategy, with one rule for the load generator and the
simulator.

A process gives every request a send time (`send_times`) and may cap how many are in flight at once
(`max_in_flight`). A request goes out at its send time or, while `max_in_flight` requests are out, at
the moment one of them completes; requests go in send-time order (ties keep workload order).

- `TraceTimestamps(time_scale)`: the workload's own arrival times, scaled (`OPEN_LOOP`: unscaled, no cap).
- `PoissonArrivals(rate, seed)`: exponential gaps at `rate` requests/s (inf: all at once).
- `ClosedLoop(c)`: all due at t = 0 with `c` in flight: the first `c` go at once, and each completion
  lets the next one (in workload order) go at that instant.

The load generator takes `schedule(specs)` (the send times) and holds its dispatcher to
`max_in_flight`; the simulator, an event loop with no clock of its own, takes `start(requests)`: an
`Arrivals` it asks for the next arrival time and tells of each completion.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from alignedserve.core.workloads.build import WorkloadSource
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.transforms import poisson_times, scaled_times, with_times

Description = dict[str, float | int | str | None]


class HasArrival(Protocol):
    """A request an event loop tracks: its workload arrival time going in, its actual one once popped."""

    arrival: float


R = TypeVar("R", bound=HasArrival)


class ArrivalProcess(ABC):
    """Send times and the in-flight cap; `schedule` and `start` apply them (module docstring)."""

    __slots__ = ()

    @property
    @abstractmethod
    def max_in_flight(self) -> int | None:
        """Requests in flight at most; None: no cap (open loop)."""

    @abstractmethod
    def send_times(self, times: Sequence[float]) -> list[float]:
        """Send times (seconds after the run starts) of requests whose workload arrival times are `times`."""

    @abstractmethod
    def describe(self) -> Description:
        """What a run's report records of the process."""

    def schedule(self, specs: Sequence[RequestSpec]) -> list[RequestSpec]:
        """The requests with their send times as `arrival_s` (same order)."""
        return with_times(specs, self.send_times([s.arrival_s for s in specs]))

    def start(self, requests: Sequence[R]) -> Arrivals[R]:
        """One run's arrivals over `requests` (in workload order, each `arrival` its workload time)."""
        return Arrivals(requests, self.send_times([r.arrival for r in requests]), self.max_in_flight)


@dataclass(frozen=True, slots=True)
class TraceTimestamps(ArrivalProcess):
    """Replay the workload's own arrival times, multiplied by `time_scale` (0.5 = twice the rate)."""

    time_scale: float = 1.0
    max_in_flight: int | None = None

    def send_times(self, times: Sequence[float]) -> list[float]:
        return scaled_times(times, self.time_scale)

    def describe(self) -> Description:
        return {"arrivals": "trace", "time_scale": self.time_scale, "max_concurrency": self.max_in_flight}


OPEN_LOOP = TraceTimestamps()  # every request at its own workload time, none held back


@dataclass(frozen=True, slots=True)
class PoissonArrivals(ArrivalProcess):
    """Open loop: exponential gaps at `rate` requests/s (inf: all at once), optionally capped in flight."""

    rate: float
    seed: int = 0
    max_in_flight: int | None = None

    def send_times(self, times: Sequence[float]) -> list[float]:
        if math.isinf(self.rate) and self.rate > 0:
            return [0.0] * len(times)
        return poisson_times(len(times), self.rate, self.seed)

    def describe(self) -> Description:
        return {"arrivals": "poisson", "request_rate": self.rate, "max_concurrency": self.max_in_flight}


@dataclass(frozen=True, slots=True)
class ClosedLoop(ArrivalProcess):
    """`concurrency` requests in flight; each completion sends the next one at once."""

    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def max_in_flight(self) -> int | None:
        return self.concurrency

    def send_times(self, times: Sequence[float]) -> list[float]:
        return [0.0] * len(times)

    def describe(self) -> Description:
        return {"arrivals": "closed_loop", "max_concurrency": self.concurrency}


def choose_arrivals(
    source: WorkloadSource,
    request_rate: float | None,
    concurrency: int | None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> ArrivalProcess:
    """--request-rate wins (Poisson, capped by --concurrency if given); else --concurrency is a closed
    loop; else a trace replays its timestamps. A generated workload needs one of the two flags."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if request_rate is not None:
        if not request_rate > 0:
            raise ValueError(f"request rate must be > 0 requests/s (or inf), got {request_rate}")
        return PoissonArrivals(request_rate, seed, concurrency)
    if concurrency is not None:
        return ClosedLoop(concurrency)
    if source == "trace":
        return TraceTimestamps(time_scale)
    raise ValueError(
        f"the {source} workload has no timestamps: give --request-rate R (Poisson; inf = all at once) "
        "or --concurrency C (closed loop)"
    )


class Arrivals(Generic[R]):
    """One run's arrival state, for an event loop: it merges `next_at()` with its own event queue, takes
    `pop()` when the arrival comes first, and reports every completion with `completed(now)`."""

    __slots__ = ("_free", "_next", "_queue")

    def __init__(self, requests: Sequence[R], send_times: Sequence[float], max_in_flight: int | None) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        order = sorted(range(len(requests)), key=send_times.__getitem__)  # stable: ties keep workload order
        self._queue = [(send_times[i], requests[i]) for i in order]
        self._next = 0
        # with a cap: the instants free slots opened, oldest first (-inf: free from the start)
        self._free: deque[float] | None = (
            None if max_in_flight is None else deque([-math.inf] * min(max_in_flight, len(requests)))
        )

    def next_at(self) -> float | None:
        """Time of the next arrival; None while none can come (every slot busy) or none is left."""
        if self._next >= len(self._queue):
            return None
        due = self._queue[self._next][0]
        if self._free is None:
            return due
        return max(due, self._free[0]) if self._free else None

    def pop(self) -> R:
        """The next arriving request, its `arrival` set (only after `next_at()` gave a time)."""
        at = self.next_at()
        if at is None:
            raise IndexError("no request can arrive now")
        request = self._queue[self._next][1]
        self._next += 1
        if self._free is not None:
            self._free.popleft()
        request.arrival = at
        return request

    def completed(self, now: float) -> None:
        """A request completed at `now`: with a cap, its slot is free from then on."""
        if self._free is not None:
            self._free.append(now)

    @property
    def exhausted(self) -> bool:
        """Every request has arrived."""
        return self._next >= len(self._queue)
