"""services/common: settings from flags and env, JSON logs with request ids, drain, ops endpoints."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import ClassVar

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import Field

from alignedserve.core.config import ConfigError, ServiceSettings, WorkerSettings
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.main import main as gateway_main
from alignedserve.service.drain import Drain
from alignedserve.service.http import HttpServer, ops_app
from alignedserve.service.logs import configure_logging, get_logger, request_context


class DemoSettings(ServiceSettings):
    service_name: ClassVar[str] = "demo"
    port: int = Field(9000, ge=1, le=65535, description="port")
    batch: int | None = Field(None, ge=1, description="batch size")
    enabled: bool = Field(False, description="a switch")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ALIGNEDSERVE_"):
            monkeypatch.delenv(name)


def test_precedence_flag_over_service_env_over_shared_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DemoSettings.from_argv([]).port == 9000
    monkeypatch.setenv("ALIGNEDSERVE_PORT", "9001")
    assert DemoSettings.from_argv([]).port == 9001
    monkeypatch.setenv("ALIGNEDSERVE_DEMO_PORT", "9002")
    assert DemoSettings.from_argv([]).port == 9002
    assert DemoSettings.from_argv(["--port", "9003"]).port == 9003


def test_flags_cover_optional_and_bool_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_UNRELATED_KNOB", "x")  # another service's variable: ignored
    settings = DemoSettings.from_argv(["--batch", "4", "--enabled", "--log-format", "console"])
    assert (settings.batch, settings.enabled, settings.log_format) == (4, True, "console")
    assert DemoSettings.from_argv(["--no-enabled"]).enabled is False


def test_settings_are_frozen() -> None:
    settings = DemoSettings.from_argv([])
    with pytest.raises(ValueError, match="frozen"):
        settings.port = 1


def test_bad_values_name_the_flag_and_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as info:
        DemoSettings.from_argv(["--port", "0"])
    message = str(info.value)
    assert "--port (or env ALIGNEDSERVE_DEMO_PORT / ALIGNEDSERVE_PORT)" in message
    assert "greater than or equal to 1" in message and "got '0'" in message
    monkeypatch.setenv("ALIGNEDSERVE_DEMO_BATCH", "many")
    with pytest.raises(ConfigError, match=r"--batch .*valid integer.*'many'"):
        DemoSettings.from_argv([])


def test_unknown_flag_exits_with_usage_and_bad_choice_names_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        DemoSettings.from_argv(["--nope"])
    assert exited.value.code == 2 and "unrecognized arguments: --nope" in capsys.readouterr().err
    # a bad choice is a bad value like any other, whether it comes from a flag, an env var or the file
    with pytest.raises(
        ConfigError, match=r"--log-level \(or env .*'debug', 'info', 'warning' or 'error'; got 'loud'"
    ):
        DemoSettings.from_argv(["--log-level", "loud"])


def test_gateway_and_worker_settings() -> None:
    gateway = GatewaySettings.from_argv(["--port", "8001", "--backend", "engine", "--served-model-name", "x"])
    assert (gateway.port, gateway.backend, gateway.model_name) == (8001, "engine", "x")
    with pytest.raises(ConfigError, match="bus must start with redis:// or kafka://"):
        GatewaySettings.from_argv(["--bus", "http://x"])
    worker = WorkerSettings.from_argv(["--worker-id", "decode-1", "--metrics-port", "0"])
    assert (worker.worker_id, worker.metrics_port) == ("decode-1", 0)


def test_json_logs_carry_the_request_id() -> None:
    stream = io.StringIO()
    configure_logging("demo", "info", "json", stream=stream)
    log = get_logger("test")
    with request_context("req-42", user="u"):
        log.info("handled", tokens=3)
    log.info("outside")
    logging.getLogger("uvicorn.error").warning("from stdlib")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["event"] == "handled" and lines[0]["request_id"] == "req-42" and lines[0]["tokens"] == 3
    assert lines[0]["service"] == "demo" and lines[0]["level"] == "info" and "timestamp" in lines[0]
    assert "request_id" not in lines[1]
    assert lines[2]["event"] == "from stdlib" and lines[2]["level"] == "warning"


async def test_drain_waits_for_in_flight_work() -> None:
    drain = Drain(timeout_s=5.0)
    drain.install_signal_handlers((signal.SIGUSR1,))
    try:
        finished = asyncio.Event()

        async def work() -> None:
            with drain.track():
                await asyncio.sleep(0.05)
                finished.set()

        task = asyncio.create_task(work())
        await asyncio.sleep(0)
        assert drain.in_flight == 1
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.wait_for(drain.wait_begun(), 1.0)
        assert drain.draining
        assert await drain.wait_idle() is True
        assert finished.is_set()
        await task
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)


async def test_drain_times_out_and_a_second_signal_forces() -> None:
    drain = Drain(timeout_s=0.05)
    with drain.track():
        drain.begin()
        assert await drain.wait_idle() is False
    forced = Drain(timeout_s=30.0)
    forced.install_signal_handlers((signal.SIGUSR1,))
    try:
        with forced.track():
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert await asyncio.wait_for(forced.wait_idle(), 1.0) is False
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)


async def test_ops_server_health_ready_metrics() -> None:
    registry = CollectorRegistry()
    Counter("demo_events", "events", registry=registry).inc(3)
    ready = {"value": False}
    drain = Drain(timeout_s=1.0)
    server = HttpServer(ops_app("demo", lambda: ready["value"], registry, drain), "127.0.0.1", 0)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ready")).status_code == 503
            ready["value"] = True
            assert (await client.get("/ready")).json() == {"status": "ready"}
            metrics = await client.get("/metrics")
            assert "demo_events_total 3.0" in metrics.text
            drain.begin()
            answer = await client.get("/ready")
            assert (answer.status_code, answer.json()) == (503, {"status": "draining"})
    finally:
        await server.stop()


def test_gateway_main_reports_bad_config_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert gateway_main(["--max-inflight", "0"]) == 2
    err = capsys.readouterr().err
    assert "alignedserve gateway: invalid gateway configuration:" in err
    assert "--max-inflight (or env ALIGNEDSERVE_GATEWAY_MAX_INFLIGHT / ALIGNEDSERVE_MAX_INFLIGHT)" in err
    assert gateway_main(["--backend", "engine", "--tokenizer", "x"]) == 2
    assert "--tokenizer applies to --backend bus only" in capsys.readouterr().err


HANGING_TEARDOWN = """
import asyncio, os, signal, time
from alignedserve.service.drain import Drain, exit_on_stuck_teardown

async def serve():
    drain = Drain(timeout_s=5.0)
    drain.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGTERM)
    await drain.wait_begun()
    await drain.wait_idle()

exit_on_stuck_teardown(0.5)
asyncio.run(serve())
time.sleep(60)  # a teardown that never returns (a UCX context that does not let go)
"""


def test_a_signalled_service_whose_teardown_hangs_exits_after_the_grace_with_its_stacks() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HANGING_TEARDOWN], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 20  # the grace, not the 60 s hang
    assert "teardown_stuck" in done.stdout + done.stderr
    hung_at = 1 + next(i for i, line in enumerate(HANGING_TEARDOWN.splitlines()) if "time.sleep" in line)
    assert f'File "<string>", line {hung_at}' in done.stderr, done.stderr  # the stack says where it hung
