"""Graceful drain for asyncio services: SIGTERM stops new work, lets in-flight work finish, then exits.

Order on SIGTERM (what Kubernetes and `alignedserve up` expect):
1. `draining` turns on: /ready answers 503 and new work is refused, so load balancers move away;
2. in-flight work (counted with `track()`) runs to completion, for at most `timeout_s`;
3. the service stops. A second SIGTERM/SIGINT skips the wait;
4. a service process (its main called `exit_on_stuck_teardown`) then has `TEARDOWN_GRACE_S` to close
   its bus, UCX context and threads and exit. A teardown that hangs past it (seen once in a test run: a
   drained prefill worker still running 30 s after SIGTERM) writes every thread's stack to stderr and
   ends the process with exit code 0: its work drained, nothing is left to lose, and it must not sit in
   Terminating until the kubelet's SIGKILL.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from alignedserve.service.logs import get_logger

log = get_logger(__name__)

TEARDOWN_GRACE_S = 10.0  # closing the UCX context takes ~2 s on a loaded 2-core host; 5x that is a hang
# set by a service process's main only: a service run inside another process (a test, a bench) must
# never end that process
_teardown_grace_s: float | None = None


def exit_on_stuck_teardown(grace_s: float = TEARDOWN_GRACE_S) -> None:
    """From a service process's main, before it serves: after its drain, end the process if its
    teardown has not within `grace_s` (step 4 above)."""
    global _teardown_grace_s
    _teardown_grace_s = grace_s


class Drain:
    """Tracks in-flight work and the drain state of one service (use it from the event loop only)."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"drain timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._in_flight = 0
        self._begun = asyncio.Event()
        self._forced = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        return self._begun.is_set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def install_signal_handlers(
        self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
    ) -> None:
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.draining:
            log.warning("drain_forced", signal=sig.name)
            self._forced.set()
        else:
            log.info("drain_started", signal=sig.name, in_flight=self._in_flight)
            self.begin()

    def begin(self) -> None:
        """Stop taking new work (idempotent)."""
        self._begun.set()

    async def wait_begun(self) -> None:
        await self._begun.wait()

    def enter(self) -> None:
        """A unit of in-flight work starts (pair with `leave`, or use `track`)."""
        self._in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        if self._in_flight <= 0:
            raise RuntimeError("Drain.leave() without a matching enter()")
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count a unit of in-flight work for its duration."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    async def wait_idle(self) -> bool:
        """Wait until no work is in flight; False if `timeout_s` passed or a second signal forced the stop."""
        idle = asyncio.ensure_future(self._idle.wait())
        forced = asyncio.ensure_future(self._forced.wait())
        try:
            await asyncio.wait({idle, forced}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            forced.cancel()
        drained = self._idle.is_set()
        log.info("drain_finished", drained=drained, in_flight=self._in_flight)
        if _teardown_grace_s is not None:
            exit_if_still_running(_teardown_grace_s)
        return drained


def exit_if_still_running(after_s: float) -> None:
    """End the process `after_s` from now unless it has exited by then, with every thread's stack on
    stderr (where the teardown hung). A daemon thread: it runs while the interpreter joins threads and
    runs its exit hooks, where such hangs happen."""

    def expire() -> None:
        log.warning("teardown_stuck", grace_s=after_s)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(0)

    timer = threading.Timer(after_s, expire)
    timer.daemon = True
    timer.start()
