"""Supervision of `alignedserve up`'s children: a service that dies is started again, the others run on.

Each crash waits a back-off before the restart (doubling from `first_s` up to `max_s`), so a service that
cannot start does not spin. A child that stays up for `stable_s` has its back-off reset. More than
`max_restarts` crashes of one service within `window_s` is a crash loop: restarting will not help (a bad
model path, a port taken, a broker that refuses it), so `CrashLoop` stops the stack with a message that
names the service and its log. Kubernetes does the same for the same services through the kubelet
(restartPolicy Always, CrashLoopBackOff): a worker restarted here rejoins the bus exactly as a new pod.
"""

from __future__ import annotations

import subprocess
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from alignedserve.core.retry import Backoff


class CrashLoop(RuntimeError):
    """A service keeps dying right after its restarts; the message says which and where its log is."""


class Supervised(Protocol):
    """What the supervisor needs of a child (`alignedserve.up.main.Child`)."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]  # its command, run again on a restart
    env: dict[str, str]
    cpus: tuple[int, ...]  # the CPUs it is pinned to on a restart too


RESTART_BACKOFF = Backoff(1.0, max_s=30.0)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff: Backoff = RESTART_BACKOFF  # wait before the n-th consecutive restart
    max_restarts: int = 5  # restarts of one service within `window_s` before it is a crash loop
    window_s: float = 120.0
    stable_s: float = 60.0  # up this long after a restart: the next crash starts the back-off afresh


@dataclass(slots=True)
class _Record:
    """One child's crash history and pending restart."""

    crashes: deque[float] = field(default_factory=deque)  # monotonic times of its recent crashes
    consecutive: int = 0  # crashes since it last ran `stable_s`
    started_at: float = 0.0
    restart_at: float | None = None  # a restart is due at this time (the child is down)


Relaunch = Callable[[Supervised], subprocess.Popen[bytes]]  # starts the child's command again
Say = Callable[[str], None]


class Supervisor:
    """Call `poll(now)` periodically: it notices exits, schedules and performs restarts."""

    def __init__(
        self, children: list[Supervised], policy: RestartPolicy, relaunch: Relaunch, say: Say, now: float
    ) -> None:
        self.children = children
        self.policy = policy
        self._relaunch = relaunch
        self._say = say
        self._records = {child.name: _Record(started_at=now) for child in children}
        self.restarts = 0  # in all, for the exit summary and tests

    def poll(self, now: float) -> None:
        """Raises CrashLoop when a child crashed too often to keep trying."""
        for child in self.children:
            record = self._records[child.name]
            if record.restart_at is not None:
                if now >= record.restart_at:
                    self._restart(child, record, now)
                continue
            code = child.process.poll()
            if code is not None:
                self._crashed(child, record, code, now)

    def _crashed(self, child: Supervised, record: _Record, code: int, now: float) -> None:
        policy = self.policy
        if now - record.started_at >= policy.stable_s:
            record.consecutive = 0
        record.consecutive += 1
        record.crashes.append(now)
        while record.crashes and now - record.crashes[0] > policy.window_s:
            record.crashes.popleft()
        if len(record.crashes) > policy.max_restarts:
            raise CrashLoop(
                f"{child.name} crashed {len(record.crashes)} times within {policy.window_s:.0f}s "
                f"(last exit code {code}); not restarting it again. Its log: {child.log_path}"
            )
        delay = policy.backoff.delay_s(record.consecutive)
        record.restart_at = now + delay
        self._say(
            f"{child.name} exited with code {code}; restarting it in {delay:.1f}s "
            f"(crash {len(record.crashes)} of at most {policy.max_restarts} within {policy.window_s:.0f}s; "
            f"log: {child.log_path})"
        )

    def _restart(self, child: Supervised, record: _Record, now: float) -> None:
        child.process = self._relaunch(child)
        record.restart_at = None
        record.started_at = now
        self.restarts += 1
        self._say(f"{child.name} restarted (pid {child.process.pid})")
