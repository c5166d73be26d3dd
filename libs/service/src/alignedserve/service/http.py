"""The operations endpoints every service serves, and a uvicorn server that runs inside a service's loop.

- GET /health: 200 while the process runs (liveness);
- GET /ready: 200 only when the service can take work and is not draining, else 503 (readiness);
- GET /metrics: the service's Prometheus registry, text format.

A worker without its own HTTP API calls `ops_app(...)` and runs it with `HttpServer` next to its main
loop; the gateway mounts the same routes on its API app with `mount_ops_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from alignedserve.service.drain import Drain

ReadyCheck = Callable[[], bool]


def mount_ops_routes(
    app: FastAPI, ready: ReadyCheck, registry: CollectorRegistry, drain: Drain | None
) -> None:
    """Add /health, /ready and /metrics to `app`. `ready` is asked on every probe (keep it cheap)."""

    @app.get("/health", include_in_schema=False)
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready", include_in_schema=False)
    async def readiness() -> JSONResponse:
        if drain is not None and drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not ready():
            return JSONResponse({"status": "not ready"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def ops_app(service: str, ready: ReadyCheck, registry: CollectorRegistry, drain: Drain | None) -> FastAPI:
    """A FastAPI app with only the operations endpoints (for workers whose API is the bus)."""
    app = FastAPI(title=f"alignedserve {service}", docs_url=None, redoc_url=None, openapi_url=None)
    mount_ops_routes(app, ready, registry, drain)
    return app


class _InLoopServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service's `Drain` owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Serves an ASGI app from the running event loop; `port` 0 picks a free port (see `bound_port`)."""

    def __init__(
        self, app: FastAPI, host: str, port: int, log_level: str = "warning", close_timeout_s: int = 5
    ) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host = host
        self.bound_port: int = self._sock.getsockname()[1]
        # close_timeout_s bounds stop(): connections still open then are cut (their handlers cancelled).
        config = uvicorn.Config(
            app,
            log_config=None,
            log_level=log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=close_timeout_s,
        )
        self._server = _InLoopServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.bound_port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Close the listener and let open connections finish their current response."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._task = None
