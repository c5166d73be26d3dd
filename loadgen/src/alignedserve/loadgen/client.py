"""One request to an OpenAI-compatible endpoint, timed token by token.

The API flavour (completions or chat) is a strategy that builds the body and finds the text in a
response. With streaming, every SSE chunk that carries text is time-stamped on arrival; the output token
count comes from `usage.completion_tokens` when the server sends it (we ask with
`stream_options.include_usage`), else from the number of text chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from httpx_sse import SSEError, aconnect_sse

from alignedserve.loadgen import records
from alignedserve.loadgen.records import RequestRecord
from alignedserve.loadgen.sse import DONE, event_data


class ProtocolViolation(ValueError):
    """The response is not the OpenAI wire format."""


class ServerReportedError(RuntimeError):
    """The server put an `error` object in the stream."""


class OpenAiApi(Protocol):
    path: str  # appended to the /v1 base

    def prompt_fields(self, text: str) -> dict[str, Any]: ...

    def choice_text(self, choice: dict[str, Any], streaming: bool) -> str: ...


class CompletionsApi:
    path = "/completions"

    def prompt_fields(self, text: str) -> dict[str, Any]:
        return {"prompt": text}

    def choice_text(self, choice: dict[str, Any], streaming: bool) -> str:
        return str(choice.get("text") or "")


class ChatApi:
    path = "/chat/completions"

    def prompt_fields(self, text: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": text}]}

    def choice_text(self, choice: dict[str, Any], streaming: bool) -> str:
        part = choice.get("delta" if streaming else "message") or {}
        if not isinstance(part, dict):
            raise ProtocolViolation(f"choice {'delta' if streaming else 'message'} is not an object")
        return str(part.get("content") or "")


APIS: dict[str, OpenAiApi] = {"completions": CompletionsApi(), "chat": ChatApi()}


def v1_base(endpoint: str) -> str:
    """`http://host:8000` and `http://host:8000/v1` both mean the server's /v1 API."""
    base = endpoint.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"endpoint must be an http(s) URL, got {endpoint!r}")
    return base if base.endswith("/v1") else base + "/v1"


@dataclass(frozen=True, slots=True)
class ClientSettings:
    endpoint: str
    model: str
    api: str = "completions"
    stream: bool = True
    ignore_eos: bool = True  # forces exactly max_tokens outputs on servers that support it (vLLM, ours)
    stream_usage: bool = True  # ask for usage in the stream (stream_options.include_usage)
    temperature: float = 0.0
    request_timeout_s: float = 600.0  # whole request, send to last byte
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return v1_base(self.endpoint) + APIS[self.api].path

    def body(self, prompt_text: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, **APIS[self.api].prompt_fields(prompt_text)}
        body |= {"max_tokens": max_tokens, "temperature": self.temperature, "stream": self.stream}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.stream and self.stream_usage:
            body["stream_options"] = {"include_usage": True}
        return body | self.extra_body


def _first_choice(obj: dict[str, Any]) -> dict[str, Any] | None:
    choices = obj.get("choices")
    if choices is None or choices == []:
        return None
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise ProtocolViolation("`choices` is not a list of objects")
    return choices[0]


def _take_usage(record: RequestRecord, obj: dict[str, Any]) -> None:
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("completion_tokens"), int):
        record.output_len = usage["completion_tokens"]
        record.output_len_source = "usage"
    if isinstance(usage.get("prompt_tokens"), int):
        record.server_prompt_tokens = usage["prompt_tokens"]


def _parse_object(data: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise ProtocolViolation(f"not JSON: {data[:120]!r}") from e
    if not isinstance(obj, dict):
        raise ProtocolViolation(f"not a JSON object: {data[:120]!r}")
    if obj.get("error") is not None:
        raise ServerReportedError(json.dumps(obj["error"])[:300])
    return obj


class StreamReader:
    """Folds the SSE chunks of one streamed response into its record."""

    def __init__(self, api: OpenAiApi, record: RequestRecord, sent: float) -> None:
        self._api, self._record, self._sent = api, record, sent
        self._chunks = 0
        self.done = False

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == DONE:
            self.done = True
            return
        obj = _parse_object(data)
        choice = _first_choice(obj)
        if choice is not None:
            if self._api.choice_text(choice, streaming=True):
                self._record.chunk_times_s.append(now - self._sent)
                self._chunks += 1
            if choice.get("finish_reason"):
                self._record.finish_reason = str(choice["finish_reason"])
        _take_usage(self._record, obj)

    def finish(self) -> None:
        times = self._record.chunk_times_s
        self._record.ttft_s = times[0] if times else None
        if self._record.output_len_source != "usage":
            self._record.output_len = self._chunks


async def _stream(
    client: httpx.AsyncClient,
    settings: ClientSettings,
    body: dict[str, Any],
    record: RequestRecord,
    sent: float,
) -> None:
    reader = StreamReader(APIS[settings.api], record, sent)
    async with aconnect_sse(client, "POST", settings.url, json=body) as source:
        response = source.response
        if response.status_code >= 400:
            detail = (await response.aread()).decode(errors="replace")
            raise _HttpFailure(response.status_code, detail)
        # read to the end of the body even after [DONE], so the connection goes back to the pool
        async for data in event_data(response):
            if not reader.done:
                reader.on_event(data, time.perf_counter())
    reader.finish()


async def _whole(
    client: httpx.AsyncClient, settings: ClientSettings, body: dict[str, Any], record: RequestRecord
) -> None:
    response = await client.post(settings.url, json=body)
    if response.status_code >= 400:
        raise _HttpFailure(response.status_code, response.text)
    obj = _parse_object(response.text)
    choice = _first_choice(obj)
    if choice is None:
        raise ProtocolViolation("response has no choices")
    record.finish_reason = choice.get("finish_reason")
    _take_usage(record, obj)
    if record.output_len_source != "usage":
        raise ProtocolViolation("a non-streamed response without usage.completion_tokens")


class _HttpFailure(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail[:300])
        self.status = status


def _failure_kind(error: BaseException) -> str:
    if isinstance(error, _HttpFailure):
        return records.http_failure(error.status)
    if isinstance(error, TimeoutError | httpx.TimeoutException):
        return records.TIMEOUT
    if isinstance(error, SSEError):  # a 200 that is not an event stream (an httpx.TransportError)
        return records.PROTOCOL
    if isinstance(error, httpx.TransportError | httpx.StreamError):
        return records.CONNECTION
    if isinstance(error, ServerReportedError):
        return records.SERVER_ERROR
    return records.PROTOCOL


async def send_request(
    client: httpx.AsyncClient,
    settings: ClientSettings,
    record: RequestRecord,
    prompt_text: str,
    origin: float,
) -> RequestRecord:
    """Send one request and fill `record` in place (timings, token counts, or the failure kind).

    `origin` is the benchmark's start on the `time.perf_counter` clock.
    """
    body = settings.body(prompt_text, record.expected_output_len)
    sent = time.perf_counter()
    record.start_s = sent - origin
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            if settings.stream:
                await _stream(client, settings, body, record, sent)
            else:
                await _whole(client, settings, body, record)
        record.e2el_s = time.perf_counter() - sent
    except (
        _HttpFailure,
        TimeoutError,
        httpx.HTTPError,
        httpx.StreamError,
        ProtocolViolation,
        ServerReportedError,
    ) as e:
        record.e2el_s = time.perf_counter() - sent
        record.error = _failure_kind(e)
        record.error_detail = f"{type(e).__name__}: {e}"[:400]
    return record
