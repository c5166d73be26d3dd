"""Which engine computes first where prefill and decode engines share one machine's cores.

Under the `prefill-first` CPU layout (`alignedserve.core.cpu_layout`) the engines of one machine, and
under `split-spill-first` the spill engine and decode on the decode cores, agree through lock files
(`--prefill-first-lock` and a sibling): a decode step waits for the prefill forward in flight — at most
`max_wait_s`, then it steps anyway — and the next forward waits for that step. Under load the two
alternate, each with the cores they share: a prompt waiting for its first token gets all of them, and
decode steps run at full speed between forwards instead of at half speed beside them. The
locks are `flock(2)`'s: the kernel drops them when a worker dies, so a crashed worker never leaves the
other waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

POLL_S = 0.002  # between a waiting decode step's looks at the lock: a forward takes 0.1-1 s on CPU


class ComputeTurns(Protocol):
    def prefill(self) -> contextlib.AbstractContextManager[None]:
        """Held for the length of a prefill forward."""
        ...

    def decode_step(self) -> contextlib.AbstractContextManager[float]:
        """Held for the length of a decode step; entering it waits for the forward in flight (at most
        the bound) and gives the seconds waited."""
        ...


class NoTurns:
    """Every other layout: each engine computes whenever it has work."""

    @contextlib.contextmanager
    def prefill(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def decode_step(self) -> Iterator[float]:
        yield 0.0


class PrefillFirst:
    """Two flock(2) files: `forward` (held shared by every prefill worker during a forward) and `step`
    (held exclusively by a decode worker from the moment its step waits to the step's end). A prefill
    worker starts a forward only once no decode step waits or runs, so the two alternate under load:
    one forward, then one step of every running row, as a server that runs a prefill chunk and the
    decode rows in each iteration; decode never waits for more than the forward in flight."""

    def __init__(self, lock_path: Path, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        # opened once for the process's life, created if absent: nothing is ever written to them
        self._forward = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._step = os.open(lock_path.with_name(lock_path.name + ".step"), os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def prefill(self) -> Iterator[None]:
        fcntl.flock(self._step, fcntl.LOCK_SH)  # waits while a decode step waits or runs
        fcntl.flock(self._forward, fcntl.LOCK_SH)  # taken before `step` is let go: no step slips between
        fcntl.flock(self._step, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._forward, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def decode_step(self) -> Iterator[float]:
        fcntl.flock(self._step, fcntl.LOCK_EX)  # waits only while a prefill worker starts a forward
        try:
            yield self._wait_for_forward()
        finally:
            fcntl.flock(self._step, fcntl.LOCK_UN)

    def _wait_for_forward(self) -> float:
        started = time.monotonic()
        while not self._no_forward_running() and time.monotonic() - started < self.max_wait_s:
            time.sleep(POLL_S)
        return time.monotonic() - started

    def _no_forward_running(self) -> bool:
        try:
            fcntl.flock(self._forward, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a prefill worker holds it shared
            return False
        fcntl.flock(self._forward, fcntl.LOCK_UN)
        return True


def compute_turns(lock_path: str, max_wait_ms: int) -> ComputeTurns:
    """PrefillFirst on `lock_path`, or NoTurns where it is empty (every layout but prefill-first)."""
    return PrefillFirst(Path(lock_path), max_wait_ms / 1000) if lock_path else NoTurns()
