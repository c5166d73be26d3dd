"""structlog JSON logs, one object per line, with the request id of whatever is being handled.

Request ids travel in contextvars: bind them once where a request enters (`request_context`) and every
log line written while handling it (in this task and the tasks it spawns) carries them. Standard-library
loggers (uvicorn, aiokafka, ...) go through the same renderer, so a service writes one format only.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import structlog
from structlog.typing import Processor

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(
    service: str, level: str = "info", fmt: str = "json", stream: TextIO | None = None
) -> None:
    """Route structlog and stdlib logging to `stream` (stderr) as JSON (or console) lines tagged `service`."""
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {sorted(_LEVELS)}, got {level!r}")
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be 'json' or 'console', got {fmt!r}")
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service),
    ]
    renderer: Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])
    # uvicorn installs its own handlers when it configures logging; send its records to ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def _add_service(service: str) -> Processor:
    def add(_logger: Any, _method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        event.setdefault("service", service)
        return event

    return add


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger


def bind_request_ids(**ids: str) -> None:
    """Adds ids learnt while handling a request (the internal id the stack knows it by) to every later
    log line of the task handling it; the task's context ends with the request, and the ids with it."""
    structlog.contextvars.bind_contextvars(**ids)


@contextmanager
def request_context(request_id: str, client_request_id: str = "", **values: Any) -> Iterator[None]:
    """Every log line inside carries `request_id` (and `values`), and `client_request_id` (the client's
    X-Request-Id, carried in the bus messages) when there is one; restored on exit."""
    labels = {"client_request_id": client_request_id} if client_request_id else {}
    with structlog.contextvars.bound_contextvars(request_id=request_id, **labels, **values):
        yield
