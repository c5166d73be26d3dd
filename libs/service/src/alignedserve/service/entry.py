"""The one `main` every back-end service shares: parse its frozen config, set up logging, serve."""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from alignedserve.bus import BusUnavailable
from alignedserve.core.config import ConfigError, ServiceSettings, settings_or_exit_code
from alignedserve.service import loop
from alignedserve.service.drain import exit_on_stuck_teardown
from alignedserve.service.logs import configure_logging

S = TypeVar("S", bound=ServiceSettings)


def run_service(
    settings_cls: type[S],
    serve: Callable[[S], Coroutine[Any, Any, int]],
    argv: list[str],
    description: str | None,
    fatal: tuple[type[Exception], ...] = (),
) -> int:
    """Exit 2 with a message for a bad config or a `fatal` start-up error (e.g. a model that does not
    load), 0 after --check-config, 130 on Ctrl-C, else what `serve` returns."""
    name = settings_cls.service_name
    prog = f"alignedserve {name}"
    settings = settings_or_exit_code(settings_cls, argv, prog, description)
    if isinstance(settings, int):
        return settings
    configure_logging(name, settings.log_level, settings.log_format)
    exit_on_stuck_teardown()  # this is the service's process: a teardown that hangs must not keep it
    try:
        return loop.run(serve(settings), settings.event_loop)
    except (ConfigError, *fatal) as exc:  # type: ignore[misc]  # mypy cannot read a starred tuple of types
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except BusUnavailable:  # the runtime logged why, in one line; a traceback would bury it
        return 2
    except KeyboardInterrupt:
        return 130
