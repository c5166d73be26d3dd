"""Apply a CPU placement to this process: torch's thread count, the CPUs it runs on, its niceness."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

START_NICE = os.nice(0)  # the niceness this process started at; a placement's is added to it


def place_process(threads: int | None, cpus: Sequence[int] = (), nice: int = 0) -> None:
    """`threads` None and `cpus` empty leave those as they are. Every thread the process has now is
    moved and niced (torch's pool may exist already: loading weights runs parallel ops; an engine may be
    built in an executor thread while its steps run in another); later ones inherit from their creator.
    Linux keeps a niceness per thread: `os.nice` alone left the threads that run the steps at 0."""
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        if cpus:
            os.sched_setaffinity(tid, cpus)
        own = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(own, START_NICE + nice))  # only ever up (down: privilege)
    if threads is not None:
        torch.set_num_threads(threads)
