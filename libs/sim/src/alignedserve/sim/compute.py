"""How engine work turns into wall time: a device per worker, or every engine on one machine's cores.

The cost model says how long a prefill pass or a decode iteration takes with the whole device to
itself (its *work*, in seconds). The cluster starts each pass or iteration as a job here and is told
when jobs end; a strategy that re-times running jobs when another starts or ends says so, and the
cluster moves their completion events.

- `DedicatedDevices` (the paper's GPUs, one per worker): a job ends `work` seconds after it starts.
- `SharedCores` (this repository's stack on one CPU machine: every engine runs its own threads on the
  same cores): processor sharing — the active jobs split the machine equally, so a decode iteration
  that overlaps a prefill pass takes twice its work and the pass is delayed by what the iteration
  took. Decode runs iteration by iteration here (no spans): every start or end re-times the others.
"""

from __future__ import annotations

from typing import Protocol

JobKey = tuple[str, int]  # (what runs: "prefill" or "decode", worker index)
Ends = list[tuple[JobKey, float]]  # (job, when it now ends) for every job whose end is (re)set


class Compute(Protocol):
    per_iteration: bool  # decode must be simulated one iteration at a time (spans would go stale)

    def start(self, key: JobKey, work_s: float, now: float) -> Ends:
        """A job begins: its end, and the new ends of the jobs it slows."""
        ...

    def finish(self, key: JobKey, now: float) -> Ends:
        """A job ended (its event fired): the new ends of the jobs it no longer slows."""
        ...


class DedicatedDevices:
    """Every worker has its own device: nothing a worker does slows another."""

    per_iteration = False

    def start(self, key: JobKey, work_s: float, now: float) -> Ends:
        return [(key, now + work_s)]

    def finish(self, key: JobKey, now: float) -> Ends:
        return []


class SharedCores:
    """Processor sharing: n active jobs each progress at 1/n of the machine's speed."""

    per_iteration = True

    def __init__(self) -> None:
        self._left: dict[JobKey, float] = {}  # job -> work still to do (seconds of the whole machine)
        self._at = 0.0  # when `_left` was last brought up to date

    def start(self, key: JobKey, work_s: float, now: float) -> Ends:
        if key in self._left:
            raise ValueError(f"job {key!r} is already running")
        self._advance(now)
        self._left[key] = max(0.0, work_s)
        return self._ends(now)

    def finish(self, key: JobKey, now: float) -> Ends:
        self._advance(now)
        if self._left.pop(key, None) is None:
            return []
        return self._ends(now)

    def _advance(self, now: float) -> None:
        if self._left and now > self._at:
            done = (now - self._at) / len(self._left)
            for key in self._left:
                self._left[key] = max(0.0, self._left[key] - done)
        self._at = max(self._at, now)

    def _ends(self, now: float) -> Ends:
        """Ends if nothing else starts: the smallest job finishes first, then the rest speed up."""
        ends: Ends = []
        t, done = now, 0.0
        active = len(self._left)
        for key, left in sorted(self._left.items(), key=lambda item: item[1]):
            t += (left - done) * active
            done = left
            active -= 1
            ends.append((key, t))
        return ends


COMPUTE: dict[str, type[Compute]] = {"dedicated": DedicatedDevices, "shared": SharedCores}
