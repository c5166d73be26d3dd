"""An engine on CPU applies its placement to the whole process: every thread pinned and niced, also when
the engine is built in a thread other than the one that later starts the threads running its steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os, threading, torch
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.random_model import preset_config, random_model
torch.set_num_threads(2)
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's thread pool exists before the engine starts
loaded = random_model(preset_config("llama-tiny"), torch.float32, "cpu")
config = EngineConfig(num_threads=1, cpus=(CPU,), nice=3, num_blocks=8)
builder = threading.Thread(target=lambda: LLMEngine(config, loaded=loaded))  # as a worker's executor does
builder.start(); builder.join()
later = []
step = threading.Thread(target=lambda: later.append((os.nice(0), torch.get_num_threads())))  # started later
step.start(); step.join()
tids = os.listdir("/proc/self/task")
threads = {t: sorted(os.sched_getaffinity(int(t))) for t in tids}
nices = {t: os.getpriority(os.PRIO_PROCESS, int(t)) for t in tids}
print(json.dumps({"threads": threads, "nices": nices, "later": later[0]}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one CPU of one proves nothing")
def test_every_thread_is_pinned_and_niced_and_later_threads_inherit_it() -> None:
    cpu = max(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", CHILD.replace("CPU", str(cpu))],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["threads"]) >= 2  # the main thread and torch's pool at least
    assert all(cpus == [cpu] for cpus in report["threads"].values())
    assert set(report["nices"].values()) == {os.nice(0) + 3}
    assert report["later"] == [os.nice(0) + 3, 1]  # a thread started later runs the engine's placement
