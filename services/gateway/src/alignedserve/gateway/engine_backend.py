"""`EngineBackend`: an in-process LLMEngine behind the gateway (`alignedserve gateway --backend engine`).

The one gateway module that imports the engine (and so torch): `main` imports it only for this backend,
which needs the `alignedserve-gateway[engine]` extra.

The engine is synchronous and compute-bound, so it runs on its own thread: the event loop only enqueues
commands (add / abort) and receives per-step outputs. The thread loops: apply queued commands, run one
`engine.step()`, hand each request's new tokens to its asyncio queue; with nothing to do it blocks on
the command queue. Everything the engine owns is touched by that thread only.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from alignedserve.core.config import ConfigError
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.request import RequestError, RequestOutput
from alignedserve.engine.request import TokenLogprob as EngineTokenLogprob
from alignedserve.gateway.backend import (
    FINISH_ABORT,
    BackendError,
    BackendStats,
    GenerationRequest,
    RequestRejected,
    TokenDelta,
    TokenLogprob,
)
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.tokenizer import PromptTokenizer, eos_token_ids
from alignedserve.service.logs import get_logger

log = get_logger(__name__)

_IDLE_WAIT_S = 0.5  # how long the idle engine thread blocks on its command queue between checks


@dataclass(frozen=True)
class _Add:
    request: GenerationRequest
    accepted: Future[None]  # resolved by the engine thread: None, or the engine's RequestError


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


def engine_config(settings: GatewaySettings) -> EngineConfig:
    """The engine's config from the gateway's flags; ConfigError names what is wrong."""
    try:
        return EngineConfig(
            model=settings.model,
            device=settings.device,
            dtype=settings.dtype,
            num_blocks=settings.num_kv_blocks,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
        )
    except ValueError as exc:
        raise ConfigError(f"invalid engine configuration: {exc}") from None


class EngineBackend:
    """GenerationBackend over one LLMEngine on a background thread."""

    def __init__(
        self, config: EngineConfig, engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine
    ) -> None:
        self._config = config
        self._factory = engine_factory
        self._engine: LLMEngine | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[TokenDelta]] = {}  # loop side: request id -> its deltas
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("EngineBackend.start() has not run")
        return self._engine

    @property
    def supports_logprobs(self) -> bool:
        return True

    def prompt_tokenizer(self) -> PromptTokenizer:
        """The engine's own tokenizer and limits: the gateway then validates exactly what the engine takes."""
        engine = self.engine
        eos = frozenset(engine.eos_token_ids) | eos_token_ids(engine.tokenizer)
        return PromptTokenizer(engine.tokenizer, engine.max_model_len, eos)

    async def start(self) -> None:
        """Load the model (off the loop) and start the engine thread."""
        self._loop = asyncio.get_running_loop()
        self._engine = await asyncio.to_thread(self._factory, self._config)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        log.info("engine_ready", model=self._engine.model_id, max_model_len=self._engine.max_model_len)

    async def close(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(TokenDelta(index=0, token_ids=(), finish_reason=FINISH_ABORT))
            self._streams.pop(request_id, None)

    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failure is None

    def stats(self) -> BackendStats:
        engine = self._engine
        if engine is None:
            return BackendStats()
        allocator = engine.allocator
        # Reads from another thread: len() and ints are consistent snapshots under the GIL.
        return BackendStats(
            num_requests_running=len(engine.scheduler.running),
            num_requests_waiting=len(engine.scheduler.waiting),
            decode_kv_usage=allocator.num_used / allocator.num_blocks,
        )

    def kv_capacity_tokens(self) -> int:
        """Tokens the engine's KV cache holds (admission's default token budget); 0 before it starts."""
        engine = self._engine
        return 0 if engine is None else engine.allocator.num_blocks * engine.allocator.block_size

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if not self.ready():
            raise BackendError(f"the engine is not running ({self._failure or 'not started'})")
        if request.request_id in self._streams:
            raise RequestRejected(f"request id {request.request_id!r} is already running")
        stream: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._streams[request.request_id] = stream
        accepted: Future[None] = Future()
        self._commands.put(_Add(request, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except RequestError as exc:
            self._streams.pop(request.request_id, None)
            raise RequestRejected(str(exc)) from None
        return self._deltas(request.request_id, stream)

    async def _deltas(self, request_id: str, stream: asyncio.Queue[TokenDelta]) -> AsyncIterator[TokenDelta]:
        try:
            while True:
                delta = await stream.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._streams.pop(request_id, None)

    async def cancel(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._streams.pop(request_id, None)

    # --- engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._apply_commands(engine, block=not engine.has_unfinished()):
                    return
                if engine.has_unfinished():
                    self._deliver(engine.step())
        except BaseException as exc:  # the loop must learn the engine died, or requests hang forever
            log.exception("engine_failed")
            self._failure = exc
            self._post(self._fail_all)

    def _apply_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False on stop."""
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Abort):
                engine.abort(command.request_id)
            else:
                self._add(engine, command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, engine: LLMEngine, command: _Add) -> None:
        req = command.request
        try:
            engine.add_request(req.request_id, list(req.prompt_token_ids), req.sampling)
        except RequestError as exc:
            command.accepted.set_exception(exc)
            return
        command.accepted.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deltas = [(o.request_id, _to_delta(o)) for o in outputs if o.new_token_ids or o.finished]
        if deltas:
            self._post(lambda: self._dispatch(deltas))

    def _post(self, callback: Callable[[], Any]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(callback)

    # --- loop side ---------------------------------------------------------------------------------------

    def _dispatch(self, deltas: list[tuple[str, TokenDelta]]) -> None:
        for request_id, delta in deltas:
            stream = self._streams.get(request_id)
            if stream is not None:  # None: cancelled meanwhile
                stream.put_nowait(delta)

    def _fail_all(self) -> None:
        for stream in self._streams.values():
            stream.put_nowait(TokenDelta(index=0, token_ids=(), finish_reason=FINISH_ABORT))


def _to_delta(output: RequestOutput) -> TokenDelta:
    new = output.new_token_ids
    start = len(output.output_token_ids) - len(new)
    logprobs: tuple[TokenLogprob, ...] = ()
    if output.logprobs is not None:
        logprobs = tuple(_logprob(lp) for lp in output.logprobs[start : start + len(new)])
    prompt = output.prompt_logprobs
    return TokenDelta(
        index=start,
        token_ids=tuple(new),
        logprobs=logprobs,
        finish_reason=output.finish_reason,
        prompt_logprobs=None if prompt is None or start > 0 else tuple(_logprob(lp) for lp in prompt),
    )


def _logprob(entry: EngineTokenLogprob) -> TokenLogprob:
    return TokenLogprob(entry.token_id, entry.logprob, tuple(entry.top))
