"""One admitted request from submission to its last chunk: backend stream, text, metrics, cancellation.

`Generation.close()` is the single exit path, called from a `finally` (shielded from cancellation) by
both the streaming and the non-streaming handlers. If the backend has not finished by then (the client
disconnected, a stop string ended the text first, an error), the request is cancelled in the backend,
so its KV blocks are freed everywhere; then the admission slot is released.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import anyio

from alignedserve.gateway.backend import (
    BackendBusy,
    BackendError,
    GenerationBackend,
    GenerationRequest,
    TokenDelta,
)
from alignedserve.gateway.metrics import RequestTimer
from alignedserve.gateway.textstream import OutputAssembler, OutputChunk
from alignedserve.gateway.tokenizer import PromptTokenizer
from alignedserve.service.logs import get_logger

log = get_logger(__name__)


class Generation:
    def __init__(
        self,
        backend: GenerationBackend,
        request: GenerationRequest,
        tokenizer: PromptTokenizer,
        timer: RequestTimer,
        release: Callable[[], None],
    ) -> None:
        self.request = request
        self._backend = backend
        self._assembler = OutputAssembler(request, tokenizer)
        self._timer = timer
        self._release = release
        self._deltas: AsyncIterator[TokenDelta] | None = None
        self._closed = False
        self._sent = True  # whether the backend may hold the request (then close() cancels it)

    @property
    def finished(self) -> bool:
        return self._assembler.finished

    async def start(self) -> None:
        """Submit to the backend; raises RequestRejected / BackendError before any output."""
        try:
            self._deltas = await self._backend.submit(self.request)
        except BackendBusy:
            # Never handed over: nothing to cancel, and a cancel would wait on the very resource that
            # was busy.
            self._sent = False
            raise

    async def chunks(self) -> AsyncIterator[OutputChunk]:
        """Final text chunks until the finish; raises BackendError on a backend failure."""
        if self._deltas is None:
            raise RuntimeError("Generation.start() must be awaited before chunks()")
        async for delta in self._deltas:
            chunk = self._assembler.feed(delta)
            if chunk is None:
                continue
            now = time.monotonic()
            self._timer.tokens(len(chunk.token_ids), now)
            if chunk.finish_reason is not None:
                self._timer.finish(chunk.finish_reason, now)
                log.info(
                    "request_finished",
                    id=self.request.request_id,
                    finish_reason=chunk.finish_reason,
                    completion_tokens=chunk.num_output_tokens,
                    seconds=round(now - self.request.arrival_time, 4),
                )
            yield chunk
            if self._assembler.finished:
                return
        if not self._assembler.finished:
            raise BackendError("the backend ended the request without a finish reason")

    async def close(self, reason: str = "cancelled") -> None:
        """Cancel in the backend unless it finished; release the slot. Idempotent, cancellation-proof."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                if self._sent and not self._assembler.backend_finished:
                    await self._cancel(reason)
                if not self.finished:
                    self._timer.fail(reason)
                aclose = getattr(self._deltas, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._release()

    async def _cancel(self, reason: str) -> None:
        """A backend whose cancel fails must not skip the rest of close (metrics, the slot)."""
        log.info("request_cancelled", reason=reason, finished=self.finished)
        try:
            await self._backend.cancel(self.request.request_id)
        except Exception as exc:
            log.warning("request_cancel_failed", error=repr(exc))
