"""The seam between the HTTP layer and whatever generates tokens.

The gateway tokenizes, validates and streams; a `GenerationBackend` turns prompt token ids into output
token ids. Two real backends implement it: `EngineBackend` (an in-process engine, single-process
serving and tests) and `BusBackend` (the disaggregated stack over the control bus). Backends deal in
token ids only: detokenization and stop strings happen once, in the gateway (`textstream.py`), so every
backend produces the same text for the same tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from alignedserve.core.sampling import SamplingParams

# Finish reasons a backend reports. "abort": cancelled or failed; the gateway never shows it as a
# successful finish (a cancelled client is gone; a failed request becomes a 500 / an error event).
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class BackendError(RuntimeError):
    """The backend could not run a request (not a client error): surfaces as HTTP 500."""


class BackendBusy(BackendError):
    """The backend cannot take the request now (its connections stayed busy): HTTP 429, retry later."""


class BackendUnavailable(BackendError):
    """What the backend needs (its control bus) does not answer: HTTP 503, retry later."""


class RequestRejected(BackendError):
    """The backend refuses this request as given (e.g. it can never fit its KV cache): HTTP 400."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # max_tokens already resolved against the context length
    arrival_time: float  # time.monotonic() when the gateway accepted it
    client_request_id: str = ""  # the client's label (X-Request-Id or the body's request_id): logs only


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the `n` most likely alternatives (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output tokens of one request, in order; `index` is the position of token_ids[0] in the output.

    `logprobs` is empty unless the request asked for them (then one entry per token). `finish_reason` is
    set on the last delta of a request ("stop", "length" or "abort").
    """

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    # Prompt scoring (`sampling.prompt_logprobs`): one entry per prompt token after the first, on the
    # delta that carries the first output token; None on every other delta.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class BackendStats:
    """Load figures behind the gateway's gauges (fractions in [0, 1])."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_pool_usage: float = 0.0  # host KV pool bytes held / budget (all live kvpools)
    decode_kv_usage: float = 0.0  # decode-side KV blocks in use / capacity (all decode workers)
    extra: dict[str, float] = field(default_factory=dict)


class GenerationBackend(Protocol):
    """What the gateway needs from a token generator."""

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Start `request` and return its token deltas; the last one carries a finish reason.

        Raises RequestRejected / BackendError (before any token) if the request cannot be started.
        Abandoning the iterator does not cancel the request; call `cancel`.
        """
        ...

    async def cancel(self, request_id: str) -> None:
        """Stop the request everywhere and free its resources (idempotent; unknown ids are ignored)."""
        ...

    def ready(self) -> bool:
        """True when requests can be served now."""
        ...

    def stats(self) -> BackendStats: ...

    @property
    def supports_logprobs(self) -> bool: ...

    async def start(self) -> None:
        """Acquire resources (threads, connections); called once before serving."""
        ...

    async def close(self) -> None:
        """Abort what runs and release resources."""
        ...
