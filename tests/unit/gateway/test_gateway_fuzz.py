"""Hostile input against the gateway on a real socket (a real, tiny engine behind it): a schemathesis run
of its own OpenAPI schema (valid and invalid bodies), then oversized bodies, invalid UTF-8 and huge
`n` / `max_tokens` / `logit_bias`. Every answer is below 500, every error is OpenAI-shaped, and the
gateway is healthy and serving after it.

`make test` runs ALIGNEDSERVE_FUZZ_CASES generated cases (default 240, well under a minute here); the
chaos run asks for more: `ALIGNEDSERVE_FUZZ_CASES=2000 pytest tests/unit/gateway/test_gateway_fuzz.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import schemathesis
from gateway_helpers import build_tiny_engine, gateway_settings
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode
from transformers import PreTrainedTokenizerFast

from alignedserve.engine.engine import LLMEngine
from alignedserve.gateway.app import create_app
from alignedserve.gateway.engine_backend import EngineBackend
from alignedserve.service.http import HttpServer

FUZZ_CASES = int(os.environ.get("ALIGNEDSERVE_FUZZ_CASES", "240"))
MAX_BODY_BYTES = 256 * 1024
ERROR_FIELDS = {"message", "type", "param", "code"}


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


def _check(response: Any) -> None:
    """Below 500; an error is OpenAI-shaped JSON."""
    status = response.status_code
    assert status < 500, (status, response.text[:500])
    if status >= 400:
        body = json.loads(response.content)
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
        assert isinstance(body["error"]["message"], str) and body["error"]["type"]


def _healthy(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0}
        served = http.post("/v1/completions", json=body)
        assert served.status_code == 200, served.text


def _fuzz(url: str, operation: Any, mode: GenerationMode, cases: int, statuses: Counter[int]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def call(case: Case) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = "tiny"  # the served model: generated bodies get past the 404
        response = case.call(base_url=url, timeout=60)
        statuses[response.status_code] += 1
        _check(response)

    call()


def test_generated_requests_from_the_openapi_schema(gateway: str) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == "POST"]
    assert {op.path for op in posts} == {"/v1/completions", "/v1/chat/completions"}
    statuses: Counter[int] = Counter()
    per_run = -(-FUZZ_CASES // (2 * len(posts)))
    for operation in posts:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(gateway, operation, mode, per_run, statuses)
    assert sum(statuses.values()) >= FUZZ_CASES * 0.9, statuses
    assert statuses[200] > 0 and statuses[400] > 0, statuses  # both kinds of input were reached
    _healthy(gateway)


HOSTILE_BODIES: list[tuple[str, bytes, dict[str, str]]] = [
    ("oversized", json.dumps({"model": "tiny", "prompt": "x" * (2 * MAX_BODY_BYTES)}).encode(), {}),
    ("invalid utf-8", b'{"model": "tiny", "prompt": "\xff\xfe\xfa"}', {}),
    ("invalid utf-8 key", b'{"mo\xc3\x28del": "tiny"}', {}),
    ("not json", b"\x00\x01\x02", {}),
    ("truncated", b'{"model": "tiny", "prompt": "hel', {}),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, {}),
    ("huge n", json.dumps({"model": "tiny", "prompt": "hi", "n": 10**12}).encode(), {}),
    ("huge max_tokens", json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 10**30}).encode(), {}),
    (
        "huge logit_bias",
        json.dumps({"model": "tiny", "prompt": "hi", "logit_bias": {str(10**40): 1}}).encode(),
        {},
    ),
    (
        "many logit_bias",
        json.dumps(
            {"model": "tiny", "prompt": "hi", "logit_bias": {str(i): 1 for i in range(20_000)}}
        ).encode(),
        {},
    ),
    ("nan bias", b'{"model": "tiny", "prompt": "hi", "logit_bias": {"1": NaN}}', {}),
    ("huge tokens", json.dumps({"model": "tiny", "prompt": [10**20, -1]}).encode(), {}),
    ("wrong content type", b"model=tiny", {"content-type": "application/x-www-form-urlencoded"}),
]


@pytest.mark.parametrize(("name", "body", "headers"), HOSTILE_BODIES, ids=[h[0] for h in HOSTILE_BODIES])
def test_hostile_bodies_are_refused_in_shape(
    gateway: str, name: str, body: bytes, headers: dict[str, str]
) -> None:
    with httpx.Client(base_url=gateway, timeout=60) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            request_headers = {"content-type": "application/json", **headers}
            response = http.post(path, content=body, headers=request_headers)
            _check(response)
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
        _check(response)
        _check(http.get("/v1/%ff%fe"))
        _check(http.request("PATCH", "/v1/completions"))
    _healthy(gateway)
