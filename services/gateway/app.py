"""The gateway's FastAPI app: OpenAI endpoints, admission control, streaming, ops endpoints.

A request's path: parse and validate the body (400) -> model check (404) -> not ready / draining (503)
-> tokenize, context check (400) -> admission (429 + Retry-After when `max_inflight` requests run) ->
backend. The response is one JSON body, or SSE events ending with `data: [DONE]`. A client that goes
away cancels its request in the backend (see `generation.py`).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Gauge
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alignedserve.engine.sampling import SamplingParams
from alignedserve_services.common.drain import Drain
from alignedserve_services.common.http import mount_ops_routes
from alignedserve_services.common.logs import get_logger, request_context
from alignedserve_services.gateway.backend import (
    BackendError,
    GenerationBackend,
    GenerationRequest,
    RequestRejected,
)
from alignedserve_services.gateway.config import GatewaySettings
from alignedserve_services.gateway.endpoints import (
    Body,
    ChatEndpoint,
    CompletionsEndpoint,
    Endpoint,
    StreamRenderer,
)
from alignedserve_services.gateway.errors import APIError, install_error_handlers
from alignedserve_services.gateway.generation import Generation
from alignedserve_services.gateway.metrics import GatewayMetrics
from alignedserve_services.gateway.prepare import check_model, sampling_params
from alignedserve_services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    new_request_id,
)
from alignedserve_services.gateway.render import SSE_DONE, sse
from alignedserve_services.gateway.textstream import OutputChunk
from alignedserve_services.gateway.tokenizer import PromptTokenizer

log = get_logger(__name__)

COMPLETIONS = CompletionsEndpoint()
CHAT = ChatEndpoint()


class Admission:
    """At most `limit` requests in flight; each is also counted by the drain so SIGTERM waits for it."""

    def __init__(self, limit: int, retry_after_s: int, drain: Drain, gauge: Gauge) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self._drain = drain
        self._gauge = gauge

    def admit(self) -> Callable[[], None]:
        """Take a slot (429 with Retry-After when none is free); returns the release callback."""
        if self.in_flight >= self.limit:
            retry = str(self.retry_after_s)
            raise APIError(
                429,
                f"The server is at its limit of {self.limit} requests in flight. Retry after {retry} s.",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry},
            )
        self._change(+1)
        self._drain.enter()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._change(-1)
                self._drain.leave()

        return release

    def _change(self, delta: int) -> None:
        self.in_flight += delta
        self._gauge.set(self.in_flight)


@dataclass
class GatewayState:
    settings: GatewaySettings
    backend: GenerationBackend
    tokenizer: PromptTokenizer
    metrics: GatewayMetrics
    drain: Drain
    admission: Admission
    created: int = field(default_factory=lambda: int(time.time()))

    def ready(self) -> bool:
        return self.backend.ready() and not self.drain.draining

    def check_accepting(self) -> None:
        if self.drain.draining or not self.backend.ready():
            state = "shutting down" if self.drain.draining else "not ready yet"
            retry = str(self.settings.retry_after_s)
            raise APIError(503, f"The server is {state}; retry later.", headers={"Retry-After": retry})


def create_app(
    settings: GatewaySettings,
    backend: GenerationBackend,
    tokenizer: PromptTokenizer,
    drain: Drain | None = None,
) -> FastAPI:
    """The gateway app. The caller starts and closes `backend` (see main.py); the app only uses it."""
    migrations = getattr(backend, "migration_counts", None)  # only the bus backend migrates requests
    metrics = GatewayMetrics(settings.model_name, backend.stats, settings.throughput_window_s, migrations)
    drain = drain or Drain(settings.drain_timeout_s)
    gauge = metrics.in_flight.labels(settings.model_name)
    admission = Admission(settings.max_inflight, settings.retry_after_s, drain, gauge)
    state = GatewayState(settings, backend, tokenizer, metrics, drain, admission)
    app = FastAPI(title="AlignedServe", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.gateway = state
    install_error_handlers(app)
    mount_ops_routes(app, state.ready, metrics.registry, state.drain)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=settings.model_name,
            root=settings.model,
            max_model_len=tokenizer.max_model_len,
            created=state.created,
        )
        return ModelList(data=[card])

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(state, request, body, COMPLETIONS)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serve(state, request, body, CHAT)

    return app


_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestIdMiddleware:
    """Binds a request id (the client's X-Request-Id if sane, else a new one) to logs and the response.

    Plain ASGI rather than `@app.middleware`: that wrapper re-streams responses through a task group and
    would get between the SSE response and the client's disconnect.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", [])).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID_OK.match(given) else new_request_id("req")
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        with request_context(request_id):
            await self.app(scope, receive, send_with_id)


async def _serve(state: GatewayState, request: Request, body: Body, endpoint: Endpoint[Body]) -> Response:
    try:
        return await _admit_and_run(state, request, body, endpoint)
    except APIError as exc:
        state.metrics.record_rejection(exc.status)
        raise


def _prepare(state: GatewayState, body: Body, endpoint: Endpoint[Body]) -> tuple[list[int], SamplingParams]:
    """Prompt token ids and sampling parameters, or the 4xx that says what to change."""
    check_model(body.model, state.settings.model_name)
    state.check_accepting()
    prompt_ids = endpoint.prompt_ids(body, state.tokenizer)
    logprobs = endpoint.logprobs(body)
    names = endpoint.param_names(body)
    if logprobs is not None and not state.backend.supports_logprobs:
        raise APIError(400, "logprobs are not supported by this server's backend", names.logprobs)
    params = sampling_params(
        body,
        prompt_len=len(prompt_ids),
        tokenizer=state.tokenizer,
        output_limit=endpoint.output_limit(body),
        default_max_tokens=endpoint.default_max_tokens,
        logprobs=logprobs,
        max_logprobs=state.settings.max_logprobs,
        names=names,
    )
    return prompt_ids, params


async def _start(state: GatewayState, request: Request, body: Body, endpoint: Endpoint[Body]) -> Generation:
    """Admit (429 when full) and submit to the backend (400 if it refuses the request, 500 if it fails)."""
    prompt_ids, params = _prepare(state, body, endpoint)
    release = state.admission.admit()
    request_id = f"{endpoint.id_prefix}-{body.request_id or request.state.request_id}"
    model = state.settings.model_name
    gen_request = GenerationRequest(request_id, model, tuple(prompt_ids), params, time.monotonic())
    state.metrics.record_admitted(len(prompt_ids))
    timer = state.metrics.request_timer(gen_request.arrival_time)
    generation = Generation(state.backend, gen_request, state.tokenizer, timer, release)
    try:
        await generation.start()
    except RequestRejected as exc:
        await generation.close("rejected")
        raise APIError(400, str(exc)) from None
    except BackendError as exc:
        await generation.close("backend_error")
        raise APIError(500, f"generation failed to start: {exc}") from None
    log.info(
        "request_admitted",
        id=request_id,
        prompt_tokens=len(prompt_ids),
        max_tokens=params.max_tokens,
        user=body.user,
    )
    return generation


async def _admit_and_run(
    state: GatewayState, request: Request, body: Body, endpoint: Endpoint[Body]
) -> Response:
    generation = await _start(state, request, body, endpoint)
    request_id, model = generation.request.request_id, state.settings.model_name
    prompt_tokens = len(generation.request.prompt_token_ids)
    if body.stream:
        renderer = endpoint.stream_renderer(
            request_id, model, int(time.time()), prompt_tokens, body, state.tokenizer
        )
        return _SSEResponse(_sse_events(generation, renderer, body.include_usage), generation)
    chunks = await _collect_unless_disconnected(request, generation)
    if chunks is None:
        return Response(status_code=499)  # nginx's "client closed request"; nobody is there to read it
    response = endpoint.response(request_id, model, chunks, prompt_tokens, body, state.tokenizer)
    return JSONResponse(response.model_dump())


async def _collect_unless_disconnected(request: Request, generation: Generation) -> list[OutputChunk] | None:
    """All chunks of a non-streaming request, or None if the client disconnected first (then cancelled)."""

    async def collect() -> list[OutputChunk]:
        return [chunk async for chunk in generation.chunks()]

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector.done():
            try:
                return collector.result()
            except BackendError as exc:
                await generation.close("backend_error")
                raise APIError(500, f"generation failed: {exc}") from None
        collector.cancel()
        await generation.close("client_disconnected")
        return None
    finally:
        watcher.cancel()
        collector.cancel()
        await generation.close("request_ended")


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _sse_events(
    generation: Generation, renderer: StreamRenderer, include_usage: bool
) -> AsyncIterator[str]:
    for event in renderer.start():
        yield event
    completion_tokens = 0
    try:
        async for chunk in generation.chunks():
            completion_tokens = chunk.num_output_tokens
            for event in renderer.chunk(chunk):
                yield event
    except BackendError as exc:
        await generation.close("backend_error")
        yield sse(APIError(500, f"generation failed: {exc}").body())
        yield SSE_DONE
        return
    if include_usage:
        yield renderer.usage(completion_tokens)
    yield SSE_DONE


class _SSEResponse(StreamingResponse):
    """SSE that always closes its Generation: cancels in the backend when the client went away."""

    def __init__(self, events: AsyncIterator[str], generation: Generation) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose: Any = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
                reason = "ended_before_backend" if self._generation.finished else "client_disconnected"
                await self._generation.close(reason)
