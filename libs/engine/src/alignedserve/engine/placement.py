"""Apply a CPU placement to this process: torch's thread count, the CPUs it runs on, its niceness."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

START_NICE = os.nice(0)  # the niceness this process started at; a placement's is added to it


def place_process(threads: int | None, cpus: Sequence[int] = (), nice: int = 0) -> None:
    """`threads` None and `cpus` empty leave those as they are. Every thread the process has now is
    moved (torch's pool may exist already: loading weights runs parallel ops); later ones inherit."""
    if cpus:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cpus)
    os.nice(max(0, START_NICE + nice - os.nice(0)))  # only ever up: going back down needs privilege
    if threads is not None:
        torch.set_num_threads(threads)
