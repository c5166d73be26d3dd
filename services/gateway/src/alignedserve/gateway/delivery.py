"""How a request's choices reach the client: merged as they come, collected whole (cancelled if the
client leaves first), or as SSE events; every exit closes every choice's Generation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from alignedserve.gateway.backend import BackendError
from alignedserve.gateway.endpoints import StreamRenderer
from alignedserve.gateway.errors import APIError
from alignedserve.gateway.generation import Generation
from alignedserve.gateway.protocol import UsageInfo
from alignedserve.gateway.render import SSE_DONE, sse
from alignedserve.gateway.textstream import OutputChunk


async def merged(generations: list[Generation]) -> AsyncIterator[tuple[int, OutputChunk]]:
    """(choice index, chunk) from every generation as each arrives; raises the first BackendError."""
    if len(generations) == 1:
        async for chunk in generations[0].chunks():
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, OutputChunk | Exception | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for chunk in generation.chunks():
                await queue.put((index, chunk))
            await queue.put((index, None))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(generations: list[Generation], reason: str) -> None:
    for generation in generations:
        await generation.close(reason)


async def collect_unless_disconnected(
    request: Request, generations: list[Generation]
) -> list[list[OutputChunk]] | None:
    """Every choice's chunks, or None if the client disconnected first (then all are cancelled)."""

    async def collect() -> list[list[OutputChunk]]:
        outputs: list[list[OutputChunk]] = [[] for _ in generations]
        async for index, chunk in merged(generations):
            outputs[index].append(chunk)
        return outputs

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector.done():
            try:
                return collector.result()
            except BackendError as exc:
                await close_all(generations, "backend_error")
                raise APIError(500, f"generation failed: {exc}") from None
        collector.cancel()
        await close_all(generations, "client_disconnected")
        return None
    finally:
        watcher.cancel()
        collector.cancel()
        await close_all(generations, "request_ended")


async def wait_for_disconnect(receive: Receive) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def sse_events(
    generations: list[Generation],
    renderers: list[StreamRenderer],
    include_usage: bool,
    prompt_tokens: int,
    shown: list[bool],
) -> AsyncIterator[str]:
    """shown: per choice, whether its output counts (not with `max_tokens: 0`)."""
    for renderer in renderers:
        for event in renderer.start():
            yield event
    completion_tokens = [0] * len(generations)
    try:
        async for index, chunk in merged(generations):
            completion_tokens[index] = chunk.num_output_tokens if shown[index] else 0
            for event in renderers[index].chunk(chunk):
                yield event
    except BackendError as exc:
        await close_all(generations, "backend_error")
        yield sse(APIError(500, f"generation failed: {exc}").body())
        yield SSE_DONE
        return
    if include_usage:
        yield renderers[0].usage(UsageInfo.of(prompt_tokens, sum(completion_tokens)))
    yield SSE_DONE


class SSEResponse(EventSourceResponse):
    """SSE as OpenAI streams it, and always closing its generations: cancels in the backend when the
    client went away.

    sse-starlette writes each yielded string (one line of compact JSON, or [DONE]) as `data: <it>` and a
    blank line, with "\n" line ends (its default is "\r\n"); no `event:` or `id:` fields. Every `PING_S`
    it also sends a `: ping - <time>` comment, which SSE clients skip and which keeps proxies from closing
    a stream that waits in a queue.
    """

    PING_S = 15

    def __init__(self, events: AsyncIterator[str], generations: list[Generation]) -> None:
        # sse-starlette adds `X-Accel-Buffering: no` (no proxy buffering of tokens) itself
        super().__init__(events, headers={"Cache-Control": "no-cache"}, sep="\n", ping=self.PING_S)
        self._events = events
        self._generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose: Any = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
                for generation in self._generations:
                    reason = "ended_before_backend" if generation.finished else "client_disconnected"
                    await generation.close(reason)
