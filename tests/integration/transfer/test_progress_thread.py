"""The UCX progress thread sleeps while nothing happens (ucxx's own 1 ms epoll timeout woke it ~900
times a second), and transfers still complete at once."""

from __future__ import annotations

import asyncio
import os

import numpy as np

from alignedserve.transfer.endpoint import TransferEndpoint
from alignedserve.transfer.runtime import PROGRESS_EPOLL_TIMEOUT_MS

PULLS_TIMED = 5


def thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def wakeups(threads: set[str]) -> int:
    """Voluntary context switches so far of these threads of this process."""
    total = 0
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt"))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return total


async def test_an_idle_context_wakes_rarely_and_a_pull_still_completes_at_once() -> None:
    payload = np.arange(1 << 16, dtype=np.uint8)
    destination = np.zeros_like(payload)
    loop = asyncio.get_running_loop()
    earlier = thread_ids()
    async with TransferEndpoint() as holder, TransferEndpoint() as puller:
        holder.registry.publish("first", b"h", payload)
        holder.registry.publish("second", b"h", payload, release_after_pull=False)  # pulled again
        await puller.pull(holder.address, "first", destination)  # the connection is set up (~70 ms)
        ucx_threads = thread_ids() - earlier  # the UCX context's: progress, notifier, async events
        assert ucx_threads, "the test needs a fresh UCX context (an earlier test left one in use)"
        before = wakeups(ucx_threads)
        await asyncio.sleep(1.0)
        idle = wakeups(ucx_threads) - before
        took_s = []
        for _ in range(PULLS_TIMED):
            destination[:] = 0
            started = loop.time()
            await puller.pull(holder.address, "second", destination)
            took_s.append(loop.time() - started)
            assert np.array_equal(destination, payload)
    assert idle < 4 * 1000 // PROGRESS_EPOLL_TIMEOUT_MS + 50, idle  # with a 1 ms timeout: ~900
    # Woken by the submission and UCX's events, not by the timeout, which would add 50 ms to every
    # pull. The fastest of a few is taken: a busy 2-core machine can delay any one of them.
    assert min(took_s) < PROGRESS_EPOLL_TIMEOUT_MS / 2 / 1000, took_s
