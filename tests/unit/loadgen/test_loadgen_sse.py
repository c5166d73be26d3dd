"""Reading SSE event data from a streamed response (httpx-sse underneath)."""

from __future__ import annotations

import httpx
import pytest
from httpx_sse import SSEError

from alignedserve.loadgen.sse import event_data


async def feed_all(
    lines: list[str], *, end: str = "\n", content_type: str = "text/event-stream"
) -> list[str]:
    """The event data of a body made of `lines`, each ended by "\\n" (the last one by `end`)."""
    body = "".join(line + "\n" for line in lines[:-1]) + lines[-1] + end
    response = httpx.Response(200, headers={"content-type": content_type}, content=body.encode())
    return [data async for data in event_data(response)]


async def test_data_events_end_at_blank_lines() -> None:
    assert await feed_all(['data: {"a":1}', "", 'data: {"a":2}', "", "data: [DONE]", ""]) == [
        '{"a":1}',
        '{"a":2}',
        "[DONE]",
    ]


async def test_multiline_data_comments_and_other_fields() -> None:
    lines = [": keep-alive", "event: message", "id: 7", "data: line one", "data:line two", "retry: 10", ""]
    assert await feed_all(lines) == ["line one\nline two"]


async def test_blank_lines_without_data_give_nothing_and_unterminated_tail_flushes() -> None:
    assert await feed_all(["", "", "data: last"]) == ["last"]
    assert await feed_all(["", "", "data: last"], end="") == ["last"]


async def test_crlf_line_ends_and_a_ping_comment() -> None:
    body = ': ping - 2025-01-01 00:00:00\r\n\r\ndata: {"a":1}\r\n\r\ndata: [DONE]\r\n\r\n'
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())
    assert [data async for data in event_data(response)] == ['{"a":1}', "[DONE]"]


async def test_a_body_that_is_not_an_event_stream_is_refused() -> None:
    with pytest.raises(SSEError):
        await feed_all(['{"choices": []}'], content_type="application/json")


async def test_only_cr_and_lf_end_lines() -> None:
    """U+2028 and U+0085 may stand raw in JSON (ensure_ascii=False): they do not split a data line."""
    text = "a\u2028b\x85c"
    assert await feed_all([f'data: {{"text":"{text}"}}', ""]) == [f'{{"text":"{text}"}}']
