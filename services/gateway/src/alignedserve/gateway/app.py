"""The gateway's FastAPI app: OpenAI endpoints, admission control, streaming, ops endpoints.

A request's path: parse and validate the body (400) -> model check (404) -> not ready / draining (503)
-> tokenize, context check (400) -> admission (429 + Retry-After when `max_inflight` requests run) ->
backend. A request of several choices (`n`, batched prompts) runs each as its own backend request and
admits each. The response is one JSON body, or SSE events ending with `data: [DONE]`. A client that goes
away cancels its requests in the backend (`generation.py`, `delivery.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alignedserve.core.sampling import SamplingParams
from alignedserve.gateway.access import ApiKeyMiddleware, access_from_settings
from alignedserve.gateway.admission import Admission, token_budget
from alignedserve.gateway.backend import (
    BackendBusy,
    BackendError,
    BackendUnavailable,
    GenerationBackend,
    GenerationRequest,
    RequestRejected,
)
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.delivery import SSEResponse, collect_unless_disconnected, sse_events
from alignedserve.gateway.endpoints import (
    Body,
    ChatEndpoint,
    CompletionsEndpoint,
    Endpoint,
)
from alignedserve.gateway.errors import APIError, install_error_handlers
from alignedserve.gateway.generation import Generation
from alignedserve.gateway.limits import BodyLimitMiddleware
from alignedserve.gateway.metrics import GatewayMetrics
from alignedserve.gateway.prepare import check_model, sampling_params
from alignedserve.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    UsageInfo,
    new_request_id,
)
from alignedserve.gateway.render import ChoiceOutput
from alignedserve.gateway.tokenizer import PromptTokenizer
from alignedserve.service.drain import Drain
from alignedserve.service.http import mount_ops_routes
from alignedserve.service.logs import bind_request_ids, get_logger, request_context

log = get_logger(__name__)

COMPLETIONS = CompletionsEndpoint()
CHAT = ChatEndpoint()


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
    capacity = getattr(backend, "kv_capacity_tokens", None)  # the KV behind the gateway, when known
    budget = token_budget(
        settings.max_queued_tokens, capacity, settings.max_inflight, tokenizer.max_model_len
    )

    def pool_usage() -> float:
        return backend.stats().kv_pool_usage

    admission = Admission(settings.max_inflight, settings.retry_after_s, drain, gauge, budget, pool_usage)
    state = GatewayState(settings, backend, tokenizer, metrics, drain, admission)
    app = FastAPI(title="AlignedServe", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.gateway = state
    install_error_handlers(app)
    mount_ops_routes(app, state.ready, metrics.registry, state.drain)
    # Outermost last: every answer carries X-Request-Id; a request without a valid key is refused before
    # its body is read; an oversized body before it is parsed.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(
        ApiKeyMiddleware, access=access_from_settings(settings), open_paths=settings.open_paths
    )
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
    """Gives every request a new internal id and binds it, with the client's X-Request-Id, to the logs.

    The client's id (1-128 of [A-Za-z0-9._:-]) is only a label: it is echoed back and logged (as
    `request_id` and `client_request_id`), never used as the key the backend and the stack know the request by, so two
    clients sending the same id (or one reusing it) cannot touch each other's requests. Without one the
    response carries the internal id.

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
        label = given if _REQUEST_ID_OK.match(given) else None
        request_id = new_request_id("req")
        scope.setdefault("state", {}).update(request_id=request_id, client_request_id=label)
        echoed = (label or request_id).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", echoed)]
            await send(message)

        # Logs name the request as its client does (`request_id`: the label, else the internal id); the
        # key the stack knows it by is bound as `internal_id` once the request is admitted (`_start`).
        labels = {"client_request_id": label} if label else {}
        with request_context(label or request_id, **labels):
            await self.app(scope, receive, send_with_id)


async def _serve(state: GatewayState, request: Request, body: Body, endpoint: Endpoint[Body]) -> Response:
    try:
        return await _admit_and_run(state, request, body, endpoint)
    except APIError as exc:
        state.metrics.record_rejection(exc.status)
        raise


@dataclass(frozen=True, slots=True)
class PlannedChoice:
    """One choice of a request: which prompt, sampled how. Choices of one prompt are consecutive."""

    prompt_ids: list[int]
    params: SamplingParams


def _prepare(state: GatewayState, body: Body, endpoint: Endpoint[Body]) -> list[PlannedChoice]:
    """Every choice's prompt token ids and sampling parameters, or the 4xx that says what to change."""
    check_model(body.model, state.settings.model_name)
    state.check_accepting()
    prompts = endpoint.prompts(body, state.tokenizer)
    logprobs = endpoint.logprobs(body)
    names = endpoint.param_names(body)
    if logprobs is not None and not state.backend.supports_logprobs:
        raise APIError(400, "logprobs are not supported by this server's backend", names.logprobs)
    count, limit = len(prompts) * body.n, state.settings.max_inflight
    if count > limit:
        raise APIError(
            400,
            f"The request asks for {count} choices ({len(prompts)} prompt(s) x n={body.n}), but this "
            f"server runs at most {limit} sequences at once. Lower n or split the prompts.",
            "n",
        )
    choices = []
    for prompt_ids in prompts:
        params = sampling_params(
            body,
            prompt_len=len(prompt_ids),
            tokenizer=state.tokenizer,
            output_limit=endpoint.output_limit(body),
            default_max_tokens=endpoint.default_max_tokens,
            logprobs=logprobs,
            max_logprobs=state.settings.max_logprobs,
            names=names,
            prompt_logprobs=endpoint.prompt_logprobs(body),
        )
        choices += [PlannedChoice(prompt_ids, _nth_sample(params, j)) for j in range(body.n)]
    return choices


def _nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n choices: a seeded request gives choice j the seed + j, so that the n differ and a
    repeat of the request repeats all n."""
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**63)


async def _start(
    state: GatewayState, request: Request, body: Body, endpoint: Endpoint[Body]
) -> tuple[str, list[Generation]]:
    """Admit every choice (429 when the slots run out) and submit each to the backend (400 if it refuses
    one, 500 if it fails); nothing stays admitted on an error. Returns the response id and the choices'
    generations in choice order."""
    # Tokenizing and rendering a long prompt takes seconds of CPU: a worker thread keeps the event loop
    # (other requests, /ready) responsive meanwhile. The tokenizer's encode only reads shared state.
    choices = await asyncio.to_thread(_prepare, state, body, endpoint)
    # The backend's key is always this request's own internal id: a client's `request_id` or
    # X-Request-Id only labels the response, so a repeated one cannot collide with a request in flight.
    key = f"{endpoint.id_prefix}-{request.state.request_id}"
    label = body.request_id or request.state.client_request_id
    response_id = f"{endpoint.id_prefix}-{label}" if label else key
    bind_request_ids(internal_id=key)  # the id the workers log: one grep follows the request
    generations: list[Generation] = []
    try:
        for index, choice in enumerate(choices):
            request_id = key if len(choices) == 1 else f"{key}-{index}"
            generations.append(await _start_choice(state, request_id, choice, body.user, label or ""))
    except BaseException:
        for generation in generations:
            await generation.close("sibling_rejected")
        raise
    return response_id, generations


async def _start_choice(
    state: GatewayState, request_id: str, choice: PlannedChoice, user: str | None, label: str
) -> Generation:
    prompt_ids, params = choice.prompt_ids, choice.params
    release = state.admission.admit(len(prompt_ids) + params.max_tokens)
    model = state.settings.model_name
    gen_request = GenerationRequest(request_id, model, tuple(prompt_ids), params, time.monotonic(), label)
    state.metrics.record_admitted(len(prompt_ids))
    timer = state.metrics.request_timer(gen_request.arrival_time)
    generation = Generation(state.backend, gen_request, state.tokenizer, timer, release)
    try:
        await generation.start()
    except RequestRejected as exc:
        await generation.close("rejected")
        raise APIError(400, str(exc)) from None
    except BackendBusy as exc:
        await generation.close("backend_busy")
        raise state.admission.refuse_busy(str(exc)) from None
    except BackendUnavailable as exc:
        await generation.close("backend_unavailable")
        retry = str(state.settings.retry_after_s)
        raise APIError(
            503, f"The server cannot start requests now: {exc}", headers={"Retry-After": retry}
        ) from None
    except BackendError as exc:
        await generation.close("backend_error")
        raise APIError(500, f"generation failed to start: {exc}") from None
    log.info(
        "request_admitted",
        id=request_id,
        prompt_tokens=len(prompt_ids),
        max_tokens=params.max_tokens,
        user=user,
    )
    return generation


async def _admit_and_run(
    state: GatewayState, request: Request, body: Body, endpoint: Endpoint[Body]
) -> Response:
    response_id, generations = await _start(state, request, body, endpoint)
    model = state.settings.model_name
    # Usage counts each prompt once however many choices it has (as OpenAI does).
    prompt_tokens = sum(len(g.request.prompt_token_ids) for g in generations[:: body.n])
    tokenizer = state.tokenizer
    echoes = [
        endpoint.echo(body, index // body.n, g.request.prompt_token_ids, tokenizer)
        for index, g in enumerate(generations)
    ]
    shown = [echo is None or not echo.hide_output for echo in echoes]  # max_tokens 0: no output
    if body.stream:
        created = int(time.time())
        renderers = [
            endpoint.stream_renderer(
                response_id, model, created, len(g.request.prompt_token_ids), body, tokenizer, index, echo
            )
            for index, (g, echo) in enumerate(zip(generations, echoes, strict=True))
        ]
        events = sse_events(generations, renderers, body.include_usage, prompt_tokens, shown)
        return SSEResponse(events, generations)
    outputs = await collect_unless_disconnected(request, generations)
    if outputs is None:
        return Response(status_code=499)  # nginx's "client closed request"; nobody is there to read it
    choices = [ChoiceOutput(index, chunks, echoes[index]) for index, chunks in enumerate(outputs)]
    completion = sum(
        chunks[-1].num_output_tokens for chunks, show in zip(outputs, shown, strict=True) if show
    )
    usage = UsageInfo.of(prompt_tokens, completion)
    response = endpoint.response(response_id, model, choices, usage, body, tokenizer)
    return JSONResponse(response.model_dump())
