"""The event loop a service process runs on: uvloop by default, asyncio's own on request.

uvloop is libuv behind asyncio's API. Each socket write, wake-up and timer costs a fraction of the pure
Python loop's, and a service here does little else: the gateway writes one SSE event per streamed token
and every service reads the control bus in small messages. On a machine whose cores the engines share,
what the loops spend comes out of prefill and decode (docs/benchmarks.md, "The services' event loop").
"auto" takes uvloop when it imports (it is a dependency; a platform without a wheel falls back), as
uvicorn's own `--loop auto` does; "asyncio" keeps the standard loop, e.g. to rule the loop out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from alignedserve.core.config import ConfigError, EventLoop

T = TypeVar("T")


def loop_factory(name: EventLoop) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes the loop `name` names; ConfigError when uvloop is asked for and cannot import."""
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop  # here, not at the top: a platform without its wheel still runs on "auto"
    except ImportError as exc:
        if name == "uvloop":
            raise ConfigError(
                f"--event-loop uvloop: uvloop does not import ({exc}); pip install uvloop, "
                "or choose --event-loop auto or asyncio"
            ) from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], name: EventLoop) -> T:
    """`asyncio.run(main)` on the loop `name` names."""
    try:
        factory = loop_factory(name)
    except ConfigError:
        main.close()  # never awaited: say nothing about it at exit
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
