"""Server-sent events, as OpenAI-compatible servers stream them: `data: <json>` lines, a blank line
ending each event, `data: [DONE]` ending the stream. Pure: feed it lines, it gives event payloads."""

from __future__ import annotations

DONE = "[DONE]"


class SseParser:
    """Line-fed SSE decoder (the WHATWG event-stream rules that matter for `data`-only streams).

    Lines arrive without their line terminator. Multi-line `data` fields join with "\\n"; comments
    (`:` lines) and other fields (`event`, `id`, `retry`) are ignored.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The completed event's data when `line` ends an event, else None."""
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """At end of stream: an event the server did not end with a blank line."""
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data.clear()
        return data
