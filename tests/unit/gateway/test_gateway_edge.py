"""The gateway's edge over the real app and a real (tiny) engine: API keys, body and prompt limits,
tokenization off the event loop, request identity and the queued-token admission bound."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_settings

from alignedserve.core.config import describe_settings, parse_command_line
from alignedserve.gateway.app import create_app
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.engine_backend import EngineBackend
from alignedserve.gateway.tokenizer import PromptTokenizer
from alignedserve.service.http import HttpServer
from alignedserve.service.logs import configure_logging, get_logger
from alignedserve.up.config import UpSettings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SMALL = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0}


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def _error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape, with `status` (and `code` when given)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return dict(error)


# --- API keys -------------------------------------------------------------------------------------------


def test_keys_come_from_repeated_flags_comma_lists_the_env_and_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# one a line\nfile-key-1\n\n  file-key-2  \n", encoding="utf-8")
    argv = ["--api-key", "k1", "--api-key", "k2,k3", "--api-key-file", str(key_file)]
    settings = parse_command_line(GatewaySettings, argv).settings
    assert [k.get_secret_value() for k in settings.api_key] == ["k1", "k2", "k3"]
    monkeypatch.setenv("ALIGNEDSERVE_API_KEY", "env-a, env-b")
    from_env = parse_command_line(GatewaySettings, []).settings
    assert [k.get_secret_value() for k in from_env.api_key] == ["env-a", "env-b"]
    # never shown: not in the repr, the --check-config listing or the settings' JSON
    shown = repr(settings) + describe_settings(settings, {}) + settings.model_dump_json()
    assert not any(secret in shown for secret in ("k1", "k2", "k3", "env-a"))


def test_up_hands_its_api_keys_to_the_gateway_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    up = UpSettings.from_argv(["--api-key", "k1,k2"])
    env = up.gateway_env()
    assert "k1" not in repr(up) and UpSettings.from_argv([]).gateway_env() == {}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    gateway = parse_command_line(GatewaySettings, []).settings
    assert [k.get_secret_value() for k in gateway.api_key] == ["k1", "k2"]


@pytest.fixture
async def keyed(engine_backend: EngineBackend, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    key_file = tmp_path / "keys"
    key_file.write_text("from-file\n", encoding="utf-8")
    settings = gateway_settings(api_key="alpha,beta", api_key_file=key_file)
    async with _client(create_app(settings, engine_backend, engine_backend.prompt_tokenizer())) as client:
        yield client


async def test_the_api_needs_a_bearer_key_and_the_probes_do_not(keyed: httpx.AsyncClient) -> None:
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "alpha"},
        {"X-Api-Key": "alpha"},
    ):
        refused = await keyed.post(COMPLETIONS, json=SMALL, headers=headers)
        assert _error(refused, 401, "invalid_api_key")["type"] == "invalid_request_error"
        assert refused.headers["www-authenticate"] == "Bearer"
        assert "x-request-id" in refused.headers
    assert (await keyed.get("/v1/models")).status_code == 401
    for key in ("alpha", "beta", "from-file"):
        served = await keyed.post(COMPLETIONS, json=SMALL, headers={"Authorization": f"Bearer {key}"})
        assert served.status_code == 200, served.text
    for open_path in ("/health", "/ready", "/metrics"):
        assert (await keyed.get(open_path)).status_code == 200


async def test_keys_never_reach_a_log_line(engine_backend: EngineBackend) -> None:
    stream = io.StringIO()
    configure_logging("gateway", "debug", "json", stream=stream)
    settings = gateway_settings(api_key="sk-secret-1,sk-secret-2")
    async with _client(create_app(settings, engine_backend, engine_backend.prompt_tokenizer())) as client:
        auth = {"Authorization": "Bearer sk-secret-2", "X-Request-Id": "traced"}
        assert (await client.post(COMPLETIONS, json=SMALL, headers=auth)).status_code == 200
        wrong = {"Authorization": "Bearer sk-secret-guess"}
        assert (await client.post(COMPLETIONS, json=SMALL, headers=wrong)).status_code == 401
    get_logger("test").info("settings", settings=repr(settings))
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    admitted = [line for line in lines if line["event"] == "request_admitted"]
    assert admitted and admitted[0]["client_request_id"] == "traced"
    assert admitted[0]["internal_id"].startswith("cmpl-req-")
    assert "sk-secret" not in stream.getvalue()


async def test_open_paths_are_configurable(engine_backend: EngineBackend) -> None:
    settings = gateway_settings(api_key="alpha", open_paths="/health")
    async with _client(create_app(settings, engine_backend, engine_backend.prompt_tokenizer())) as client:
        assert (await client.get("/health")).status_code == 200
        _error(await client.get("/metrics"), 401, "invalid_api_key")
        metrics = await client.get("/metrics", headers={"Authorization": "Bearer alpha"})
        assert metrics.status_code == 200


async def test_without_keys_the_api_is_open(client: httpx.AsyncClient) -> None:
    assert (await client.post(COMPLETIONS, json=SMALL)).status_code == 200


# --- body and prompt limits -----------------------------------------------------------------------------


@pytest.fixture
async def small_bodies(engine_backend: EngineBackend) -> AsyncIterator[httpx.AsyncClient]:
    settings = gateway_settings(max_body_bytes=4096)
    async with _client(create_app(settings, engine_backend, engine_backend.prompt_tokenizer())) as client:
        yield client


async def test_a_body_over_the_limit_is_413_declared_or_chunked(small_bodies: httpx.AsyncClient) -> None:
    big = json.dumps({**SMALL, "prompt": "x" * 5000}).encode()
    error = _error(await small_bodies.post(COMPLETIONS, content=big), 413, "request_too_large")
    assert "4096 bytes" in error["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while it arrives
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    _error(await small_bodies.post(COMPLETIONS, content=chunks()), 413, "request_too_large")
    assert (await small_bodies.post(COMPLETIONS, json=SMALL)).status_code == 200


async def test_a_prompt_too_long_for_the_context_is_400_in_vllm_words(
    engine_backend: EngineBackend,
) -> None:
    settings = gateway_settings(max_body_bytes=64 * 1024 * 1024)
    async with _client(create_app(settings, engine_backend, engine_backend.prompt_tokenizer())) as client:
        huge = await client.post(COMPLETIONS, json={**SMALL, "prompt": "hello world " * 1_000_000})
        error = _error(huge, 400, "context_length_exceeded")
        assert error["param"] == "prompt"
        assert error["message"].startswith("This model's maximum context length is 128 tokens. However, you ")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 100_000}]}
        error = _error(await client.post(CHAT, json=chat), 400, "context_length_exceeded")
        assert error["param"] == "messages" and "maximum context length is 128 tokens" in error["message"]
        too_long = await client.post(COMPLETIONS, json={**SMALL, "max_tokens": 1000})
        assert "However, you requested" in _error(too_long, 400, "context_length_exceeded")["message"]


@dataclasses.dataclass(frozen=True)
class SlowTokenizer(PromptTokenizer):
    """The real tokenizer, made to take seconds on prompts that start with "slow" (like a huge prompt)."""

    def encode_text(self, text: str) -> list[int]:
        if text.startswith("slow"):
            time.sleep(1.5)
        return super().encode_text(text)


async def test_tokenizing_a_slow_prompt_does_not_stall_other_requests(engine_backend: EngineBackend) -> None:
    real = engine_backend.prompt_tokenizer()
    slow = SlowTokenizer(real.tokenizer, real.max_model_len, real.eos_token_ids)
    app = create_app(gateway_settings(), engine_backend, slow)
    async with _client(app) as client:
        slow_request = asyncio.create_task(client.post(COMPLETIONS, json={**SMALL, "prompt": "slow hello"}))
        await asyncio.sleep(0.2)  # the slow one is tokenizing now
        started = time.monotonic()
        assert (await client.get("/ready")).status_code == 200
        assert (await client.post(COMPLETIONS, json=SMALL)).status_code == 200
        assert time.monotonic() - started < 1.0
        assert not slow_request.done()
        assert (await slow_request).status_code == 200


async def _real_server(backend: EngineBackend, **settings: object) -> HttpServer:
    server = HttpServer(
        create_app(gateway_settings(**settings), backend, backend.prompt_tokenizer()), "127.0.0.1", 0
    )
    await server.start()
    return server


@pytest.mark.parametrize("max_body_bytes", [8 * 1024 * 1024, 64 * 1024 * 1024])
async def test_a_20_mb_prompt_is_refused_while_small_requests_stay_fast(
    engine_backend: EngineBackend, max_body_bytes: int
) -> None:
    """Refused for its size (413) or for the context (400): either way the others are not slowed."""
    server = await _real_server(engine_backend, max_body_bytes=max_body_bytes)
    huge = json.dumps({**SMALL, "prompt": "hello world " * (20 * 1024 * 1024 // 12)}).encode()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            rejected = asyncio.create_task(http.post(COMPLETIONS, content=huge))
            await asyncio.sleep(0.05)
            started = time.monotonic()
            assert (await http.get("/ready")).status_code == 200
            assert (await http.post(COMPLETIONS, json=SMALL)).status_code == 200
            assert time.monotonic() - started < 2.0
            response = await rejected
            assert response.status_code in (400, 413)
            _error(response, response.status_code)
    finally:
        await server.stop()


# --- identity -------------------------------------------------------------------------------------------


async def test_two_requests_with_the_same_client_id_both_complete(client: httpx.AsyncClient) -> None:
    headers = {"X-Request-Id": "same-id"}
    body = {**SMALL, "max_tokens": 8, "ignore_eos": True}
    first, second = await asyncio.gather(
        client.post(COMPLETIONS, json={**body, "stream": True}, headers=headers),
        client.post(COMPLETIONS, json=body, headers=headers),
    )
    assert first.status_code == second.status_code == 200
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "same-id"
    assert first.text.rstrip().endswith("data: [DONE]")
    assert second.json()["usage"]["completion_tokens"] == 8
    # the same body `request_id` twice at once: both complete too
    twice = {**body, "request_id": "mine"}
    results = await asyncio.gather(*(client.post(COMPLETIONS, json=twice) for _ in range(2)))
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [8, 8]
    assert {r.json()["id"] for r in results} == {"cmpl-mine"}


# --- admission: queued tokens ---------------------------------------------------------------------------


async def test_queued_tokens_beyond_the_budget_get_429(engine_backend: EngineBackend) -> None:
    """Each choice queues its prompt (3 tokens here) plus its output limit; the n choices of one request
    are admitted one by one, so the second of two 53-token choices passes a 60-token budget."""
    settings = gateway_settings(max_queued_tokens=60, retry_after_s=3)
    app = create_app(settings, engine_backend, engine_backend.prompt_tokenizer())
    async with _client(app) as client:
        refused = await client.post(COMPLETIONS, json={**SMALL, "max_tokens": 50, "n": 2})
        error = _error(refused, 429, "rate_limit_exceeded")
        assert error["type"] == "rate_limit_error" and "60 queued tokens" in error["message"]
        assert refused.headers["retry-after"] == "3"
        fits = await client.post(COMPLETIONS, json={**SMALL, "max_tokens": 20, "n": 2})
        assert fits.status_code == 200, fits.text
        # alone, a request over the budget is admitted: refusing it could never succeed on retry
        alone = await client.post(COMPLETIONS, json={**SMALL, "max_tokens": 100})
        assert alone.status_code == 200, alone.text
    assert app.state.gateway.admission.queued_tokens == 0


def test_the_default_token_budget_follows_the_kv_capacity(engine_backend: EngineBackend) -> None:
    app = create_app(gateway_settings(), engine_backend, engine_backend.prompt_tokenizer())
    budget = app.state.gateway.admission.budget
    assert budget.limit() == engine_backend.kv_capacity_tokens() > 0
