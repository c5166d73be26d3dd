"""Processes of an ended test run are found by their run's pid; this run's and unmarked ones are not."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from leftovers import TEST_RUN_ENV, leftovers_of_ended_runs

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(done.stdout)  # exited: its pid names a run that has ended


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def test_only_processes_of_an_ended_run_are_leftovers(started: list[subprocess.Popen[bytes]]) -> None:
    plain = {k: v for k, v in os.environ.items() if k != TEST_RUN_ENV}
    ended = subprocess.Popen(SLEEP, env={**plain, TEST_RUN_ENV: str(dead_pid())})
    ours = subprocess.Popen(SLEEP, env={**plain, TEST_RUN_ENV: str(os.getpid())})
    unmarked = subprocess.Popen(SLEEP, env=plain)
    started += [ended, ours, unmarked]
    found = leftovers_of_ended_runs()
    assert ended.pid in found
    assert ours.pid not in found and unmarked.pid not in found
