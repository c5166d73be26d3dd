"""The process's UCX context: environment defaults, progress mode, lifetime tied to the event loop.

ucxx keeps one context (one UCX worker) per process. We run it in ucxx's "thread" progress mode with
Python futures: a C++ thread progresses the worker (blocking on its epoll fd) and moves bytes while the
event loop hashes and schedules; completions reach asyncio through a notifier thread instead of the
loop polling the worker. On a 2-core box this measured about 2x the throughput of the "blocking" and
"polling" modes, which progress UCX on the event loop itself.

ucxx starts that thread with a 1 ms epoll timeout, so an idle process woke ~900 times a second (1 % of
a core each, four such processes on one host) and preempted the engine sharing its core. The thread is
restarted with `PROGRESS_EPOLL_TIMEOUT_MS`: UCX's events and ucxx's own signal (on every submission
and on stop) still wake it at once. On the AVX-512 BF16 host the stack served 1.08x the output tokens
(docs/benchmarks.md, "The UCX progress thread's wake-ups").

The context binds to the running loop, so it is created by the first user inside the loop and torn
down when the last user leaves (a later loop, e.g. another test, gets a fresh one).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from types import ModuleType

# Defaults only: any of these already in the environment wins.
UCX_ENV_DEFAULTS: dict[str, str] = {
    # ucxx sets UCX_MEMTYPE_CACHE for older UCX; 1.21 does not know it and would warn on every start
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # progress thread + Python-future notifier (see module docstring)
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    # seconds to exchange endpoint info on connect: a dead peer fails fast instead of hanging
    "UCXPY_CONNECT_TIMEOUT": "5",
}

# How long the progress thread sleeps on its epoll fd when nothing wakes it (ucxx's default: 1 ms).
PROGRESS_EPOLL_TIMEOUT_MS = 50

_log = logging.getLogger(__name__)


class UcxRuntime:
    """Reference-counted process-wide ucxx context, bound to the event loop that created it."""

    def __init__(self) -> None:
        self._users = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ucxx: ModuleType | None = None

    def acquire(self) -> ModuleType:
        """Call from inside the event loop; returns the initialised `ucxx` module."""
        loop = asyncio.get_running_loop()
        ucxx = self._import()
        if self._loop is not None and self._loop is not loop:
            if self._users:
                raise RuntimeError("the UCX context is in use by another event loop in this process")
            self._reset(ucxx)
        if self._loop is None:
            ucxx.init()
            _slow_the_idle_progress_thread(ucxx)
            self._loop = loop
        self._users += 1
        return ucxx

    def release(self) -> None:
        self._users -= 1
        if self._users == 0 and self._ucxx is not None:
            self._reset(self._ucxx)

    def _import(self) -> ModuleType:
        if self._ucxx is None:
            for name, value in UCX_ENV_DEFAULTS.items():
                os.environ.setdefault(name, value)
            import ucxx  # after the environment: UCX reads it when the module loads

            self._ucxx = ucxx
        return self._ucxx

    def _reset(self, ucxx: ModuleType) -> None:
        gc.collect()  # endpoints and listeners hold the context until collected
        try:
            ucxx.reset()
        except Exception as error:  # a leaked endpoint keeps the old context alive; stop its thread at least
            _log.warning("UCX context reset incomplete: %s", error)
            ucxx.stop_notifier_thread()
        self._loop = None


def _slow_the_idle_progress_thread(ucxx: ModuleType) -> None:
    """Restart the context's progress thread with `PROGRESS_EPOLL_TIMEOUT_MS` (ucxx 0.52 hard-codes
    1 ms in `ThreadMode` and exposes the worker only through its private `_get_ctx`)."""
    worker = ucxx.core._get_ctx().worker
    worker.stop_progress_thread()
    worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_EPOLL_TIMEOUT_MS)


UCX = UcxRuntime()
