"""Which event loop a service runs on (`alignedserve.service.loop`, the `--event-loop` knob)."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from alignedserve.core.config import ConfigError
from alignedserve.gateway.config import GatewaySettings
from alignedserve.service import loop


async def _running_loop_type() -> type[asyncio.AbstractEventLoop]:
    return type(asyncio.get_running_loop())


def test_auto_and_uvloop_run_the_service_on_uvloop() -> None:
    assert loop.run(_running_loop_type(), "auto") is uvloop.Loop
    assert loop.run(_running_loop_type(), "uvloop") is uvloop.Loop


def test_asyncio_runs_it_on_the_standard_loop() -> None:
    kind = loop.run(_running_loop_type(), "asyncio")
    assert kind is not uvloop.Loop
    assert issubclass(kind, asyncio.BaseEventLoop)


def test_without_uvloop_auto_falls_back_and_uvloop_says_how_to_fix_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what a platform without its wheel sees: ImportError
    assert loop.run(_running_loop_type(), "auto") is not uvloop.Loop
    main = _running_loop_type()
    with pytest.raises(ConfigError, match="pip install uvloop, or choose --event-loop auto or asyncio"):
        loop.run(main, "uvloop")
    assert main.cr_frame is None  # closed, not left to warn that it was never awaited


def test_every_service_takes_the_knob_and_defaults_to_auto() -> None:
    assert GatewaySettings.from_argv([]).event_loop == "auto"
    assert GatewaySettings.from_argv(["--event-loop", "asyncio"]).event_loop == "asyncio"
    with pytest.raises(ConfigError, match="event-loop"):
        GatewaySettings.from_argv(["--event-loop", "tokio"])
