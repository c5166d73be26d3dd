"""The one thread a worker's engine is built on and every later call of it runs on.

An engine's CPU placement sets per-thread state: torch's OpenMP thread count (`torch.set_num_threads`
sets the calling thread's; a thread that already ran torch ops keeps the count it started with). Engine
calls on `asyncio.to_thread`'s pool could land on a thread that had run ops before the placement, and
then ran with the default count on the engine's pinned cores.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class EngineThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on the engine thread, awaited without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False)
