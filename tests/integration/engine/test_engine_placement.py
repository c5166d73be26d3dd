"""An engine on CPU applies its placement to the whole process: every thread pinned, niceness raised."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os, torch
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.random_model import preset_config, random_model
torch.set_num_threads(2)
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's thread pool exists before the engine starts
loaded = random_model(preset_config("llama-tiny"), torch.float32, "cpu")
engine = LLMEngine(EngineConfig(num_threads=1, cpus=(CPU,), nice=3, num_blocks=8), loaded=loaded)
threads = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps({"threads": threads, "nice": os.nice(0), "torch_threads": torch.get_num_threads()}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one CPU of one proves nothing")
def test_every_thread_is_pinned_and_the_process_niced() -> None:
    cpu = max(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", CHILD.replace("CPU", str(cpu))],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["threads"]) >= 2  # the main thread and torch's pool at least
    assert all(cpus == [cpu] for cpus in report["threads"].values())
    assert report["nice"] == os.nice(0) + 3
    assert report["torch_threads"] == 1
