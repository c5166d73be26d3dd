"""The line-fed SSE decoder."""

from __future__ import annotations

from alignedserve.loadgen.sse import SseParser


def feed_all(lines: list[str]) -> list[str]:
    parser = SseParser()
    events = [e for e in (parser.feed(line) for line in lines) if e is not None]
    tail = parser.flush()
    return events + ([tail] if tail is not None else [])


def test_data_events_end_at_blank_lines() -> None:
    assert feed_all(['data: {"a":1}', "", 'data: {"a":2}', "", "data: [DONE]", ""]) == [
        '{"a":1}',
        '{"a":2}',
        "[DONE]",
    ]


def test_multiline_data_comments_and_other_fields() -> None:
    lines = [": keep-alive", "event: message", "id: 7", "data: line one", "data:line two", "retry: 10", ""]
    assert feed_all(lines) == ["line one\nline two"]


def test_blank_lines_without_data_give_nothing_and_unterminated_tail_flushes() -> None:
    assert feed_all(["", "", "data: last"]) == ["last"]
