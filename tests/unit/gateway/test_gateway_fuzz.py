"""Hostile input against the gateway on a real socket (a real, tiny engine behind it): a schemathesis run
of its own OpenAPI schema (valid and invalid bodies), then oversized bodies, invalid UTF-8 and huge
`n` / `max_tokens` / `logit_bias`. Every answer is below 500, every error is OpenAI-shaped, and the
gateway is healthy and serving after it.

`make test` runs ALIGNEDSERVE_FUZZ_CASES generated cases (default 240, well under a minute here); `make
chaos` runs 2,000, and the same hostile bodies, against the whole stack's gateway
(tests/chaos/test_chaos_hostile.py). The cases and checks are shared: tests/openai_fuzz.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from gateway_helpers import build_tiny_engine, gateway_settings
from openai_fuzz import ERROR_FIELDS, check_answer, fuzz_openapi, hostile_bodies
from transformers import PreTrainedTokenizerFast

from alignedserve.engine.engine import LLMEngine
from alignedserve.gateway.app import create_app
from alignedserve.gateway.engine_backend import EngineBackend
from alignedserve.service.http import HttpServer

FUZZ_CASES = int(os.environ.get("ALIGNEDSERVE_FUZZ_CASES", "240"))
MAX_BODY_BYTES = 256 * 1024


class GatewayThread:
    """The gateway app with an EngineBackend, served by uvicorn on its own event loop in a thread, so the
    fuzzer (synchronous, as hypothesis is) talks to it over a real socket."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fuzzed-gateway", daemon=True)
        self.url = ""

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        assert self._started.wait(60), "the gateway did not start"
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        engine = self._engine
        backend = EngineBackend(engine.config, engine_factory=lambda _config: engine)
        await backend.start()
        # a small engine: bounds that keep each generated request short (n and tokens are fuzzed)
        settings_ = gateway_settings(max_inflight=8, max_body_bytes=MAX_BODY_BYTES)
        server = HttpServer(create_app(settings_, backend, backend.prompt_tokenizer()), "127.0.0.1", 0)
        await server.start()
        self.url = server.url
        self._stop = asyncio.Event()
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await server.stop()
            await backend.close()


@pytest.fixture(scope="module")
def gateway(hf_tokenizer: PreTrainedTokenizerFast) -> Iterator[str]:
    engine = build_tiny_engine(hf_tokenizer, max_model_len=128, num_blocks=128)
    with GatewayThread(engine) as thread:
        yield thread.url


def _healthy(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0}
        served = http.post("/v1/completions", json=body)
        assert served.status_code == 200, served.text


def test_generated_requests_from_the_openapi_schema(gateway: str) -> None:
    statuses = fuzz_openapi(gateway, FUZZ_CASES, model="tiny")
    assert sum(statuses.values()) >= FUZZ_CASES * 0.9, statuses
    assert statuses[200] > 0 and statuses[400] > 0, statuses  # both kinds of input were reached
    _healthy(gateway)


HOSTILE_BODIES = hostile_bodies("tiny", MAX_BODY_BYTES)


@pytest.mark.parametrize(("name", "body", "headers"), HOSTILE_BODIES, ids=[h[0] for h in HOSTILE_BODIES])
def test_hostile_bodies_are_refused_in_shape(
    gateway: str, name: str, body: bytes, headers: dict[str, str]
) -> None:
    with httpx.Client(base_url=gateway, timeout=60) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            request_headers = {"content-type": "application/json", **headers}
            response = http.post(path, content=body, headers=request_headers)
            check_answer(response)
            assert response.status_code in (400, 413), (name, response.status_code, response.text[:300])
    _healthy(gateway)


def _read_response(sock: socket.socket) -> str:
    """One HTTP/1.1 response with a Content-Length, as text."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return (head + b"\r\n\r\n" + body).decode("latin-1")


def test_a_declared_length_over_the_limit_is_refused_before_the_body(gateway: str) -> None:
    """A client that announces 1 TB (and sends nothing) gets its 413 at once, on a raw socket."""
    host, port = urlsplit(gateway).hostname, urlsplit(gateway).port
    assert host is not None and port is not None
    with socket.create_connection((host, port), timeout=10) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: 999999999999\r\n\r\n{")
        answer = _read_response(sock)
    status_line, _, rest = answer.partition("\r\n")
    assert status_line.split()[1] == "413", answer
    body = json.loads(rest.partition("\r\n\r\n")[2])
    assert set(body["error"]) == ERROR_FIELDS
    _healthy(gateway)


def test_invalid_utf8_in_headers_and_paths(gateway: str) -> None:
    with httpx.Client(base_url=gateway, timeout=30) as http:
        response = http.post("/v1/completions", content=b"{}", headers={"x-request-id": b"\xff\xfe"})
        check_answer(response)
        check_answer(http.get("/v1/%ff%fe"))
        check_answer(http.request("PATCH", "/v1/completions"))
    _healthy(gateway)
