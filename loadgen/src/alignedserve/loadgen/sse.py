"""Server-sent events, as OpenAI-compatible servers stream them: `data: <json>` events, `data: [DONE]`
ending the stream. Decoded by httpx-sse (the WHATWG event-stream rules: multi-line `data` joined with
"\\n"; comments and the `event`, `id` and `retry` fields are no payload)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from httpx_sse import EventSource

DONE = "[DONE]"


async def event_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each event of a streamed `response` that has any, as it arrives.

    Unlike the WHATWG rules, an event the server did not end with a blank line still counts at the end
    of the body. Raises `httpx_sse.SSEError` when the response is not `text/event-stream`.
    """
    ended = httpx.Response(
        response.status_code, headers=response.headers, stream=_BlankLineAtEnd(response.stream)
    )
    async for event in EventSource(ended).aiter_sse():
        if event.data:
            yield event.data


class _BlankLineAtEnd(httpx.AsyncByteStream):
    """The body, then a blank line (ending an unterminated last event; otherwise one more blank line,
    which is no event). Closing stays with the response the body belongs to."""

    def __init__(self, body: httpx.SyncByteStream | httpx.AsyncByteStream) -> None:
        if not isinstance(body, httpx.AsyncByteStream):
            raise TypeError("event_data reads the response of an httpx.AsyncClient")
        self._body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._body:
            yield chunk
        yield b"\n\n"

    async def aclose(self) -> None:
        return None
