"""Processes an earlier test run started and left behind, found and stopped when a run starts.

A run that pytest-timeout ends (its thread method exits the process at once, without teardown) leaves
the stacks its fixtures started running: services still on the test databases, a paused one among them
(the chaos cases SIGSTOP services), taking the cores and the bus's singletons from the next run. Every
process a run starts inherits `TEST_RUN_ENV` = the pid of its pytest process; one whose run has ended is
a leftover.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

TEST_RUN_ENV = "ALIGNEDSERVE_TEST_RUN"


def mark_this_run() -> None:
    """Every process started from here on carries this run's pid."""
    os.environ[TEST_RUN_ENV] = str(os.getpid())


def leftovers_of_ended_runs(proc: Path = Path("/proc")) -> list[int]:
    """Pids whose environment names a test run whose pytest process is gone (not this run's)."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        run = _test_run_of(entry)
        if run is not None and run != os.getpid() and not (proc / str(run)).exists():
            found.append(int(entry.name))
    return found


def stop_leftovers() -> list[int]:
    """SIGKILL every leftover (SIGCONT first: a paused process is resumed, so nothing stays stopped)."""
    stopped = []
    for pid in leftovers_of_ended_runs():
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone meanwhile, or another user's
            continue
        stopped.append(pid)
    return stopped


def _test_run_of(process: Path) -> int | None:
    try:
        environ = (process / "environ").read_bytes()
    except OSError:  # gone meanwhile, or another user's
        return None
    prefix = f"{TEST_RUN_ENV}=".encode()
    for item in environ.split(b"\0"):
        if item.startswith(prefix) and item[len(prefix) :].isdigit():
            return int(item[len(prefix) :])
    return None
