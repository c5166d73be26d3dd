"""The gateway on a real socket (uvicorn in this loop): client disconnects cancel, admission answers 429.

The engine here has a long context so a request with ignore_eos runs for seconds: long enough that the
client is certain to leave (or a second request to arrive) while it still runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from gateway_helpers import build_tiny_engine, gateway_settings
from transformers import PreTrainedTokenizerFast

from alignedserve.engine.engine import LLMEngine
from alignedserve.gateway.app import create_app
from alignedserve.gateway.engine_backend import EngineBackend
from alignedserve.service.http import HttpServer

COMPLETIONS = "/v1/completions"
LONG = {"model": "tiny", "prompt": "hello", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}


class RecordingBackend(EngineBackend):
    """The real EngineBackend; remembers which requests the gateway cancelled."""

    cancelled: list[str]

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        await super().cancel(request_id)


@pytest.fixture(scope="module")
def long_engine(hf_tokenizer: PreTrainedTokenizerFast) -> LLMEngine:
    return build_tiny_engine(hf_tokenizer, max_model_len=4096, num_blocks=1024)


@pytest.fixture
async def backend(long_engine: LLMEngine) -> AsyncIterator[RecordingBackend]:
    backend = RecordingBackend(long_engine.config, engine_factory=lambda _config: long_engine)
    backend.cancelled = []
    await backend.start()
    yield backend
    await backend.close()


async def _serve(backend: EngineBackend, **settings: object) -> HttpServer:
    app = create_app(gateway_settings(**settings), backend, backend.prompt_tokenizer())
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    return server


async def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _idle(engine: LLMEngine) -> Callable[[], bool]:
    return lambda: not engine.has_unfinished() and engine.allocator.num_used == 0


# Line iterators of streams a test still reads from: one dropped half-read is finalized by the loop, and
# httpcore then closes its connection (the server would see the client leave).
_OPEN_STREAMS: list[AsyncIterator[str]] = []


async def _first_event(response: httpx.Response) -> str:
    lines = response.aiter_lines()
    _OPEN_STREAMS.append(lines)
    async for line in lines:
        if line.startswith("data: {"):
            return line
    raise AssertionError("the stream ended before its first event")


async def test_stream_disconnect_cancels_and_frees_blocks(
    backend: RecordingBackend, long_engine: LLMEngine
) -> None:
    server = await _serve(backend)
    try:
        async with (
            httpx.AsyncClient(base_url=server.url) as http,
            http.stream("POST", COMPLETIONS, json={**LONG, "stream": True}) as response,
        ):
            request_id = response.headers["x-request-id"]
            await _first_event(response)
            assert long_engine.has_unfinished()
        # leaving the block closed the connection mid-stream
        await _eventually(lambda: backend.cancelled == [f"cmpl-{request_id}"])
        await _eventually(_idle(long_engine))
    finally:
        await server.stop()


async def test_non_stream_disconnect_cancels_and_frees_blocks(
    backend: RecordingBackend, long_engine: LLMEngine
) -> None:
    server = await _serve(backend)
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(COMPLETIONS, json=LONG, headers={"X-Request-Id": "gone"}, timeout=0.5)
        # The client's X-Request-Id only labels the request: the backend knows it by its internal id.
        await _eventually(lambda: len(backend.cancelled) == 1)
        assert backend.cancelled[0].startswith("cmpl-req-") and "gone" not in backend.cancelled[0]
        await _eventually(_idle(long_engine))
    finally:
        await server.stop()


async def test_full_admission_answers_429_with_retry_after(
    backend: RecordingBackend, long_engine: LLMEngine
) -> None:
    server = await _serve(backend, max_inflight=1, retry_after_s=2)
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            async with http.stream("POST", COMPLETIONS, json={**LONG, "stream": True}) as running:
                await _first_event(running)
                refused = await http.post(COMPLETIONS, json={**LONG, "max_tokens": 2})
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "2"
                error = refused.json()["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
                assert "limit of 1 requests in flight" in error["message"]
            await _eventually(_idle(long_engine))
            accepted = await http.post(COMPLETIONS, json={**LONG, "max_tokens": 2})
            assert accepted.status_code == 200 and accepted.json()["usage"]["completion_tokens"] == 2
    finally:
        await server.stop()
