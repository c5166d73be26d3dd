"""The discrete-event core both simulated clusters run on: a time-ordered heap of events, merged with the
run's arrivals (which come first at equal times), each event dispatched to its handler by kind."""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Sequence

from alignedserve.core.workloads.arrivals import Arrivals
from alignedserve.sim.records import SimRequest

Handler = Callable[[float, int, int], None]  # (time, a, b)


class EventQueue:
    """Events as (time, kind, seq, a, b): `seq` keeps equal times in push order (and the heap stable)."""

    __slots__ = ("events", "seq")

    def __init__(self) -> None:
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0

    def push(self, when: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, kind, self.seq, a, b))

    def drain(
        self,
        arrivals: Arrivals[SimRequest],
        arrive: Callable[[SimRequest], None],
        handlers: Sequence[Handler],
    ) -> None:
        """Run until neither arrivals nor events are left. A run allocates millions of short-lived objects
        and creates no cycles: without the cyclic collector it is faster, and the scheduler timings it
        measures are not polluted by collection pauses."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._drain(arrivals, arrive, handlers)
        finally:
            if collecting:
                gc.enable()

    def _drain(
        self,
        arrivals: Arrivals[SimRequest],
        arrive: Callable[[SimRequest], None],
        handlers: Sequence[Handler],
    ) -> None:
        events = self.events
        while True:
            due = arrivals.next_at()
            if due is not None and (not events or due <= events[0][0]):
                arrive(arrivals.pop())
                continue
            if not events:
                return
            when, kind, _, a, b = heapq.heappop(events)
            handlers[kind](when, a, b)
