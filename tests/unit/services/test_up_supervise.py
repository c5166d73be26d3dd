"""`alignedserve up`'s supervisor: restart with back-off, others untouched, a crash loop stops the stack."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from alignedserve.core.retry import Backoff
from alignedserve.up.supervise import CrashLoop, RestartPolicy, Supervised, Supervisor


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()


def run(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started = [Proc("stays", run("import time; time.sleep(60)"), Path("stays.log")),
               Proc("dies", run("raise SystemExit(3)"), Path("dies.log"))]  # fmt: skip
    yield started
    for proc in started:
        proc.process.kill()
        proc.process.wait()


def test_a_dead_child_is_restarted_after_its_backoff_and_the_others_are_left_alone(procs: list[Proc]) -> None:
    said: list[str] = []
    relaunched: list[str] = []

    def relaunch(child: Supervised) -> subprocess.Popen[bytes]:
        relaunched.append(child.name)
        return run("import time; time.sleep(60)")

    policy = RestartPolicy(Backoff(2.0, max_s=10.0), max_restarts=3, window_s=100.0)
    supervisor = Supervisor(list(procs), policy, relaunch, said.append, now=0.0)
    stays_pid = procs[0].process.pid
    procs[1].process.wait()
    supervisor.poll(1.0)
    assert relaunched == [] and "dies exited with code 3; restarting it in 2.0s" in said[0]
    supervisor.poll(2.9)
    assert relaunched == []
    supervisor.poll(3.0)
    assert relaunched == ["dies"] and said[-1].startswith("dies restarted (pid ")
    assert procs[0].process.pid == stays_pid and procs[0].process.poll() is None
    assert procs[1].process.poll() is None and supervisor.restarts == 1


def test_the_backoff_doubles_and_a_crash_loop_stops_with_the_service_and_its_log(procs: list[Proc]) -> None:
    said: list[str] = []
    policy = RestartPolicy(Backoff(1.0, max_s=3.0), max_restarts=2, window_s=60.0, stable_s=30.0)
    supervisor = Supervisor(list(procs), policy, lambda _c: run("raise SystemExit(4)"), said.append, now=0.0)
    now = 0.0
    with pytest.raises(CrashLoop, match=r"dies crashed 3 times within 60s .*dies\.log"):
        for _ in range(200):
            procs[1].process.wait()
            now += 0.25
            supervisor.poll(now)
    delays = [line.split("restarting it in ")[1].split("s ")[0] for line in said if "restarting" in line]
    assert delays == ["1.0", "2.0"]
    assert procs[0].process.poll() is None


def test_a_child_that_ran_stably_starts_its_backoff_afresh(procs: list[Proc]) -> None:
    said: list[str] = []
    policy = RestartPolicy(Backoff(1.0), max_restarts=10, window_s=5.0, stable_s=10.0)
    supervisor = Supervisor(list(procs), policy, lambda _c: run("raise SystemExit(5)"), said.append, now=0.0)
    procs[1].process.wait()
    supervisor.poll(1.0)  # crash 1: 1 s
    supervisor.poll(2.0)  # restarted at t=2
    procs[1].process.wait()
    supervisor.poll(3.0)  # crash 2, soon after: 2 s
    supervisor.poll(5.0)  # restarted at t=5
    procs[1].process.wait()
    supervisor.poll(
        20.0
    )  # crash 3, after running 15 s > stable_s: back to 1 s, and the window forgot the rest
    delays = [line.split("restarting it in ")[1].split("s ")[0] for line in said if "restarting" in line]
    assert delays == ["1.0", "2.0", "1.0"]
    assert "crash 1 of at most 10" in said[-1]
