"""Which gateways are gone, as a decode worker sees them: nobody reads their requests' tokens any more.

A gateway that dies (SIGKILL, OOM, a lost node) sends no `Cancel` for the requests it held; left alone
they would decode to their last token, holding KV blocks and batch slots for nobody. A gateway beats on
the events topic like every service, so its process is gone when:

- a newer process beats under its id (`Heard.RESTARTED`): the old one's requests have no reader;
- it said STOPPED (it drained its clients first; whatever is still here is left over);
- it stayed silent for longer than `timeout_s` of this worker's own running time. A pause of this
  worker (SIGSTOP, a frozen VM) is not the gateway's silence: after a gap between two looks longer than
  half the timeout, every gateway gets a fresh `timeout_s` to be heard again from the events backlog.

Pure (callers pass `now`, a monotonic clock); the worker turns a gone gateway into a `Cancel` of each of
its requests, the message the gateway itself would have sent.
"""

from __future__ import annotations

from alignedserve.bus.messages import ServiceKind, WorkerHeartbeat, WorkerState
from alignedserve.core.liveness import Heard, Liveness


class GatewayWatch:
    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._beats: Liveness[ServiceKind] = Liveness()
        self._last_look: float | None = None
        self._grace_until = 0.0

    def heard(self, beat: WorkerHeartbeat, now: float) -> bool:
        """Record a gateway's beat; True when it says the process that beat before is gone."""
        if beat.kind is not ServiceKind.GATEWAY:
            return False
        heard = self._beats.heard(beat, now)
        return heard is Heard.RESTARTED or (heard is not Heard.LATE and beat.state is WorkerState.STOPPED)

    def silent(self, now: float) -> set[str]:
        """Gateways (that did not say STOPPED) unheard for longer than `timeout_s` while this worker ran."""
        if self._last_look is not None and now - self._last_look > self.timeout_s / 2:
            self._grace_until = now + self.timeout_s  # this worker stood still: its backlog is unread
        self._last_look = now
        if now < self._grace_until:
            return set()
        return set(self._beats.silent(now, self.timeout_s, ServiceKind.GATEWAY))
