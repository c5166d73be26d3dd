"""alignedserve.service.compute_turns: decode steps wait for prefill forwards of other processes, through
a real flock(2) lock file, never longer than their bound, and never for a prefill worker that died."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from alignedserve.service.compute_turns import NoTurns, PrefillFirst, compute_turns

# A prefill worker's forward in another process: holds the turn until its stdin closes.
FORWARD = """
import sys
from pathlib import Path
from alignedserve.service.compute_turns import PrefillFirst
with PrefillFirst(Path(sys.argv[1]), 0.5).prefill():
    print("forward", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    return tmp_path / "prefill-first.lock"


@pytest.fixture
def forward(lock: Path) -> Iterator[subprocess.Popen[str]]:
    """A prefill forward running in another process (until its stdin is closed or it is killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FORWARD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "forward\n"
    yield proc
    proc.kill()
    proc.wait()


def decode_step_in_thread(turns: PrefillFirst) -> tuple[threading.Thread, list[float]]:
    waited: list[float] = []

    def step() -> None:
        with turns.decode_step() as seconds:
            waited.append(seconds)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    return thread, waited


def waited_now(turns: PrefillFirst) -> float:
    with turns.decode_step() as seconds:
        return seconds


def test_a_decode_step_waits_for_the_forward_of_another_process_and_goes_when_it_ends(
    lock: Path, forward: subprocess.Popen[str]
) -> None:
    turns = PrefillFirst(lock, max_wait_s=60.0)
    thread, waited = decode_step_in_thread(turns)
    thread.join(timeout=0.3)
    assert thread.is_alive()  # the forward still runs: decode waits
    assert forward.stdin is not None
    forward.stdin.close()  # the forward ends
    thread.join(timeout=30)
    assert not thread.is_alive() and 0.3 <= waited[0] < 30
    assert waited_now(turns) < 0.1  # no forward: no wait


def test_a_decode_step_waits_no_longer_than_its_bound(lock: Path, forward: subprocess.Popen[str]) -> None:
    turns = PrefillFirst(lock, max_wait_s=0.05)
    thread, waited = decode_step_in_thread(turns)
    thread.join(timeout=30)
    assert not thread.is_alive() and waited[0] >= 0.05
    assert forward.poll() is None  # the forward was not disturbed


def test_a_prefill_worker_killed_mid_forward_leaves_no_decode_step_waiting(
    lock: Path, forward: subprocess.Popen[str]
) -> None:
    turns = PrefillFirst(lock, max_wait_s=60.0)
    thread, waited = decode_step_in_thread(turns)
    forward.send_signal(signal.SIGKILL)  # the kernel drops its lock
    thread.join(timeout=30)
    assert not thread.is_alive() and waited[0] < 30


def test_prefill_workers_hold_their_turns_together(lock: Path, forward: subprocess.Popen[str]) -> None:
    second = PrefillFirst(lock, max_wait_s=60.0)
    done = threading.Event()

    def prefill() -> None:
        with second.prefill():  # shared: a second prefill worker's forward does not wait for the first
            done.set()

    threading.Thread(target=prefill, daemon=True).start()
    assert done.wait(timeout=30)


def test_the_next_forward_waits_for_the_decode_step_that_waited_for_the_last(lock: Path) -> None:
    decode, prefill = PrefillFirst(lock, max_wait_s=60.0), PrefillFirst(lock, max_wait_s=60.0)
    started = threading.Event()

    def forward() -> None:
        with prefill.prefill():
            started.set()

    with decode.decode_step():  # a step waiting or running
        threading.Thread(target=forward, daemon=True).start()
        assert not started.wait(timeout=0.3)  # no forward starts under it
    assert started.wait(timeout=30)  # the step over, the forward goes


def test_without_a_lock_file_nothing_waits() -> None:
    turns = compute_turns("", 500)
    assert isinstance(turns, NoTurns)
    with turns.decode_step() as waited, turns.prefill():
        assert waited == 0.0
