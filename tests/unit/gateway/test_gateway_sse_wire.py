"""The exact bytes of a stream (OpenAI's SSE framing through sse-starlette), a failing backend included."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from alignedserve.gateway.backend import BackendError
from alignedserve.gateway.delivery import SSEResponse, sse_events
from alignedserve.gateway.protocol import UsageInfo
from alignedserve.gateway.textstream import OutputChunk


class FailingGeneration:
    """Two chunks, then the backend fails (duck-types the part of Generation a stream uses)."""

    finished = False

    def __init__(self) -> None:
        self.closed: list[str] = []

    async def chunks(self) -> AsyncIterator[OutputChunk]:
        for n, text in enumerate(["hé", "llo"], start=1):
            yield OutputChunk(text=text, token_ids=(n,), logprobs=(), num_output_tokens=n)
        raise BackendError("the decode worker died")

    async def close(self, reason: str) -> None:
        self.closed.append(reason)


class TextRenderer:
    def start(self) -> list[str]:
        return []

    def chunk(self, chunk: OutputChunk) -> list[str]:
        return [f'{{"text":"{chunk.text}"}}']

    def usage(self, usage: UsageInfo) -> str:
        return f'{{"usage":{usage.completion_tokens}}}'


async def test_events_and_a_mid_stream_error_are_framed_as_openai_does() -> None:
    generation = FailingGeneration()
    app = FastAPI()

    @app.post("/stream")
    async def stream() -> SSEResponse:
        generations: list[Any] = [generation]
        events = sse_events(generations, [TextRenderer()], True, 3, [True])
        return SSEResponse(events, generations)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        response = await client.post("/stream")
    assert response.headers["content-type"].startswith("text/event-stream")
    error = (
        '{"error":{"message":"generation failed: the decode worker died",'
        '"type":"server_error","param":null,"code":null}}'
    )
    assert response.content.decode() == (
        f'data: {{"text":"hé"}}\n\ndata: {{"text":"llo"}}\n\ndata: {error}\n\ndata: [DONE]\n\n'
    )
    assert "backend_error" in generation.closed
